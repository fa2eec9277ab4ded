"""The console's erasure page: a tenant admin erases a person's data at their request (recovery/erasure.py)."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse

from ledger.errors import UnwindError
from ledger.models import Erasure
from recovery import selectors
from recovery.erasure import subject_erase_by
from recovery.views import forbidden

RECENT = 30


@login_required
def erasure(request):
    """GET: the form and the tenant's recent erasures; POST: erase. Tenant admins only; another tenant is not there
    (404), a member without the admin role is told so (403)."""
    access = selectors.access_for(request.user)
    admin_of = {access.tenants[tenant_id].slug: access.tenants[tenant_id]
                for tenant_id in selectors.erasure_tenant_ids(access)}  # the navigation's link asks the same
    source = request.POST if request.method == "POST" else request.GET
    slug = source.get("tenant") or (next(iter(admin_of)) if admin_of else "")
    member_of = {tenant.slug: tenant for tenant in access.tenants.values()}
    if slug not in member_of:
        if not access.roles:
            return forbidden(request, "Erasing a person's data needs the admin role in a tenant; you have no role "
                                      "in any tenant.")
        if not slug:  # no tenant named, and none administered: the page itself is not theirs (not a missing one)
            return forbidden(request, "Erasing a person's data needs the admin role in a tenant; you are "
                                      f"{', '.join(sorted(set(access.roles.values())))}.")
        raise Http404("No such tenant")
    if slug not in admin_of:
        return forbidden(request, f"Erasing a person's data needs the admin role in {slug}; you are "
                                  f"{access.roles[member_of[slug].pk]}.")
    tenant = admin_of[slug]
    form = {"subject": "", "reason": ""}
    status = 200
    if request.method == "POST":
        form = {"subject": source.get("subject", "")[:200], "reason": source.get("reason", "")[:1000]}
        try:
            result = subject_erase_by(user=request.user, tenant=tenant, subject=form["subject"],
                                      reason=form["reason"])
        except UnwindError as refused:
            messages.error(request, refused.detail)
            status = refused.status
        else:
            messages.success(request, result.sentence())
            return redirect(reverse("recovery:erasure") + f"?tenant={tenant.slug}")
    return render(request, "recovery/erasure.html", {
        "tenant": tenant, "tenants": sorted(admin_of), "form": form,
        "erasures": Erasure.objects.filter(tenant=tenant).order_by("-erased_at")[:RECENT],
    }, status=status)
