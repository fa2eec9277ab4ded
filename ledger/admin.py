"""Admin for the ledger: members are edited here; tool policy and tenant defaults only by superusers (the
deployers); ledger and audit rows are only read.

State changes to runs, actions and the audit chain go through the services (and the console), never
through a form: an edit here would also break the audit chain's fingerprints. Tools and policy are the
agents' guardrails: a staff user given the model permissions still only reads them here; tenant admins
change them through the API, pipelines with a deploy key.
"""
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html

from ledger.api.tools import policy_of
from ledger.errors import ValidationFailed
from ledger.models import (
    POLICY_FIELDS, Action, Agent, Attempt, AuditEvent, AuditHead, Checkpoint, DeployKey, Membership, Run, Tenant,
    TenantPolicyVersion, Tool,
)
from ledger.tenancy import (
    agent_create, agent_revoke, deploy_key_revoke, membership_remove, membership_set, tenant_create,
)
from ledger.policy.versions import DEFAULT_FIELDS, tenant_defaults_set, tool_policy_check, tool_upsert

class LegalHoldActions:
    """Set or clear a legal hold (docs/archive.md) on the selected runs or tenants: superusers only, each with the
    reason asked on a page of its own, and recorded in the tenant's audit chain with who and why."""

    def has_legal_hold_permission(self, request):
        return request.user.is_active and request.user.is_superuser

    def _legal_hold(self, request, queryset, held: bool):
        from ledger.archive.service import legal_hold_set

        why = request.POST.get("why", "").strip() if request.POST.get("confirm") else None
        if not why:
            return TemplateResponse(request, "admin/ledger/legal_hold.html", {
                **self.admin_site.each_context(request), "opts": self.model._meta, "objects": queryset,
                "held": held, "action": request.POST.get("action"), "asked": why is not None,
                "title": f"{'Set' if held else 'Clear'} a legal hold",
                "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            })
        changed = 0
        for obj in queryset:
            if isinstance(obj, Run):
                changed += legal_hold_set(tenant=obj.tenant, run=obj, held=held, actor=actor_of(request), why=why)
            else:
                changed += legal_hold_set(tenant=obj, held=held, actor=actor_of(request), why=why)
        self.message_user(request, f"Legal hold {'set on' if held else 'cleared from'} {changed} "
                                   f"{self.model._meta.verbose_name}(s); recorded in the audit chain.", messages.SUCCESS)
        return None

    @admin.action(description="Set a legal hold (never archived)", permissions=["legal_hold"])
    def legal_hold_on(self, request, queryset):
        return self._legal_hold(request, queryset, True)

    @admin.action(description="Clear the legal hold", permissions=["legal_hold"])
    def legal_hold_off(self, request, queryset):
        return self._legal_hold(request, queryset, False)


LEDGER_NOTE = "Ledger rows are read-only here: runs change state only through the services, the API and the console."


def actor_of(request) -> str:
    return f"user:{request.user.get_username()}"


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only: no add, change or delete, whoever asks; `note` is shown above the list."""

    note = LEDGER_NOTE

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def changelist_view(self, request, extra_context=None):
        extra = {"subtitle": self.note} if self.note else {}
        return super().changelist_view(request, {**extra, **(extra_context or {})})


class SuperuserWritesAdmin(admin.ModelAdmin):
    """Policy and who holds which role: written by superusers only; other staff, whatever their model permissions,
    only read (a staff user who could grant themselves a tenant's admin role could change its policy too)."""

    def has_add_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser


@admin.register(Tenant)
class TenantAdmin(LegalHoldActions, SuperuserWritesAdmin):
    list_display = ("slug", "name", "approval_threshold", "approval_ttl_seconds", "run_idle_timeout_seconds",
                    "retention_seconds", "legal_hold", "created_at")
    list_filter = ("approval_threshold", "legal_hold")
    search_fields = ("slug", "name")
    readonly_fields = ("created_at", "legal_hold")
    actions = ("legal_hold_on", "legal_hold_off")

    def get_readonly_fields(self, request, obj=None):
        # The hold changes through its actions only (with a reason, audited), never through this form.
        return ("slug", "created_at", "legal_hold") if obj is not None else ("created_at", "legal_hold")

    def has_delete_permission(self, request, obj=None):
        return False  # a tenant's audit chain must outlive its rows (AuditEvent protects it anyway)

    def save_model(self, request, obj, form, change):
        defaults = {name: getattr(obj, name) for name in DEFAULT_FIELDS}
        if change:
            Tenant.objects.filter(pk=obj.pk).update(name=obj.name)
            # The defaults are policy: a change is a new version, audited (see the console's policy page).
            tenant_defaults_set(tenant=Tenant.objects.get(pk=obj.pk), values=defaults, actor=actor_of(request),
                                via="admin")
            return
        # A new tenant needs its audit chain head and its first event: the service makes both.
        created = tenant_create(slug=obj.slug, name=obj.name, actor=actor_of(request))
        tenant_defaults_set(tenant=created, values=defaults, actor=actor_of(request), via="admin")
        obj.pk, obj.created_at = created.pk, created.created_at
        obj._state.adding = False


@admin.register(TenantPolicyVersion)
class TenantPolicyVersionAdmin(ReadOnlyAdmin):
    note = "Each change of a tenant's defaults is a version; they are written through the tenant, never here."
    list_display = ("tenant", "version", "approval_threshold", "approval_ttl_seconds", "actor", "created_at")
    list_filter = ("tenant",)
    list_select_related = ("tenant",)


class IssuedKeyAdmin(admin.ModelAdmin):
    """Keys made only by a command that prints them once: here they are listed by prefix and revoked, never
    added, edited or deleted (the audit chain refers to them)."""

    list_display = ("name", "tenant", "key_prefix", "created_at", "revoked_at")
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "key_prefix", "tenant__slug")
    fields = ("tenant", "name", "key_prefix", "created_at", "revoked_at")
    readonly_fields = fields
    list_select_related = ("tenant",)
    actions = ("revoke",)
    help_text = ""
    noun = "key"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request):
        return request.user.has_perm(f"ledger.change_{self.model._meta.model_name}")

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {"subtitle": self.help_text, **(extra_context or {})})

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return super().change_view(request, object_id, form_url, {"subtitle": self.help_text, **(extra_context or {})})

    def revoke(self, request, queryset):
        """Each subclass wraps this in its admin action and says how one key is revoked (`revoke_one`)."""
        revoked = 0
        for key in queryset.filter(revoked_at__isnull=True):
            self.revoke_one(key, actor_of(request))
            revoked += 1
        self.message_user(request, f"{revoked} {self.noun}(s) revoked.", messages.SUCCESS)


class AgentAddForm(forms.ModelForm):
    class Meta:
        model = Agent
        fields = ("tenant", "name")

    def clean(self):
        cleaned = super().clean()
        tenant, name = cleaned.get("tenant"), cleaned.get("name")
        if tenant is not None and name and Agent.objects.filter(tenant=tenant, name=name).exists():
            raise forms.ValidationError(f"{tenant.slug} already has an agent named {name!r}.")
        return cleaned


@admin.register(Agent)
class AgentAdmin(IssuedKeyAdmin):
    noun = "agent key"
    fields = (*IssuedKeyAdmin.fields, "person")  # who uses its MCP client (set by `create_agent --person`)
    readonly_fields = fields
    help_text = ("Add an agent here (superusers) or with `manage.py create_agent TENANT NAME`: either shows the API "
                 "key once; only its hash is stored, and only its prefix is shown here.")

    def has_add_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = AgentAddForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        return ("tenant", "name") if obj is None else self.fields

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.readonly_fields

    def save_model(self, request, obj, form, change):
        # The service makes the key, stores its hash and records the audit event; the key is shown once, below.
        agent, key = agent_create(tenant=form.cleaned_data["tenant"], name=form.cleaned_data["name"],
                                  actor=actor_of(request))
        obj.pk, obj.key_prefix, obj.created_at = agent.pk, agent.key_prefix, agent.created_at
        obj._state.adding = False
        request.issued_agent_key = key

    def save_related(self, request, form, formsets, change):
        pass  # an agent has no related rows to save

    def log_addition(self, request, obj, message):
        pass  # the audit chain has it (agent.created); the admin log would be a second record with less in it

    def response_add(self, request, obj, post_url_continue=None):
        """The key, on this page and nowhere else: rendered, not redirected (no message cookie, no log line)."""
        response = TemplateResponse(request, "admin/ledger/agent/key_once.html", {
            **self.admin_site.each_context(request), "agent": obj, "key": request.issued_agent_key,
            "opts": self.model._meta, "title": f"API key of {obj.name}",
        })
        response["Cache-Control"] = "no-store"
        return response

    def revoke_one(self, key, actor: str) -> None:
        agent_revoke(agent=key, actor=actor)

    @admin.action(description="Revoke the selected agents' API keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        super().revoke(request, queryset)


@admin.register(DeployKey)
class DeployKeyAdmin(IssuedKeyAdmin):
    noun = "deploy key"
    help_text = ("Deploy keys write tools and policy for a pipeline (never runs or actions). They are created only "
                 "with `manage.py create_deploy_key TENANT NAME`, which prints the key once; only its hash is stored.")

    def revoke_one(self, key, actor: str) -> None:
        deploy_key_revoke(key=key, actor=actor)

    @admin.action(description="Revoke the selected deploy keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        super().revoke(request, queryset)


@admin.register(Membership)
class MembershipAdmin(SuperuserWritesAdmin):
    list_display = ("user", "tenant", "role")
    list_filter = ("role", "tenant")
    search_fields = ("user__username", "user__email", "tenant__slug")
    list_select_related = ("user", "tenant")
    autocomplete_fields = ("user",)

    def get_readonly_fields(self, request, obj=None):
        return ("user", "tenant") if obj is not None else ()

    def save_model(self, request, obj, form, change):
        # Through the service, so that every grant of a role is in the tenant's audit chain.
        saved = membership_set(tenant=obj.tenant, user=obj.user, role=obj.role, actor=actor_of(request))
        obj.pk = saved.pk
        obj._state.adding = False

    def delete_model(self, request, obj):
        membership_remove(membership=obj, actor=actor_of(request))

    def delete_queryset(self, request, queryset):
        for membership in queryset.select_related("user"):
            membership_remove(membership=membership, actor=actor_of(request))


class ToolVersionForm(forms.ModelForm):
    """Validates an edit as the API validates a policy (`parse_tool`), naming the setting at fault."""

    class Meta:
        model = Tool
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        tenant = cleaned.get("tenant") or (self.instance.tenant if self.instance.tenant_id else None)
        if tenant is None or self.errors:
            return cleaned
        draft = Tool(**{name: value for name, value in cleaned.items() if name in POLICY_FIELDS})
        try:
            tool_policy_check(tenant=tenant, name=cleaned.get("name") or self.instance.name, spec=policy_of(draft))
        except ValidationFailed as error:
            raise forms.ValidationError(error.detail) from None
        return cleaned


@admin.register(Tool)
class ToolAdmin(SuperuserWritesAdmin):
    """Tool policy versions, written by superusers only. Saving the current version writes the next one (through
    `tool_upsert`, so it is validated, audited and voids approvals that waited under it); earlier versions can only
    be read."""

    form = ToolVersionForm
    list_display = ("name", "version", "is_current", "tenant", "action_class", "saga_role", "risk", "approval",
                    "executor", "actor", "created_at")
    list_filter = ("is_current", "tenant", "action_class", "saga_role", "risk", "approval", "executor")
    search_fields = ("name", "description", "endpoint")
    list_select_related = ("tenant",)
    readonly_fields = ("version", "is_current", "actor", "created_at")
    fieldsets = (
        (None, {"fields": ("tenant", "name", "description", "describe")}),
        ("Policy", {"fields": ("action_class", "saga_role", "risk", "approval", "approvals_required")}),
        ("Execution", {"fields": ("executor", "endpoint", "timeout_seconds", "max_attempts", "backoff_seconds",
                                  "honours_idempotency_key", "key_fields")}),
        ("Target, snapshots and verification", {"fields": ("target_type", "target_from", "snapshot", "verify", "lookup")}),
        ("Arguments and compensation", {"fields": ("args_schema", "compensation")}),
        ("Version", {"fields": ("version", "is_current", "actor", "created_at")}),
    )

    def get_readonly_fields(self, request, obj=None):
        if obj is not None:
            return (*self.readonly_fields, "tenant", "name")
        return self.readonly_fields

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and (obj is None or obj.is_current)

    def has_delete_permission(self, request, obj=None):
        return False  # a version is history: actions and approvals point at it

    def save_model(self, request, obj, form, change):
        tool, _ = tool_upsert(tenant=obj.tenant, name=obj.name, spec=policy_of(obj), actor=actor_of(request),
                              via="admin")
        # The admin redirects to (and logs) the version written, not the one the form was opened on.
        obj.pk, obj.version, obj.is_current = tool.pk, tool.version, tool.is_current
        obj._state.adding = False


def console_url(url_name: str, pk: int) -> str:
    """A link into the operator console, or nothing where the console is not installed."""
    try:
        return reverse(url_name, args=[pk])
    except NoReverseMatch:
        return ""


@admin.register(Run)
class RunAdmin(LegalHoldActions, ReadOnlyAdmin):
    list_display = ("id", "tenant", "agent", "status", "pivot_committed", "attention_reason", "created_at",
                    "finished_at", "legal_hold", "timeline")
    list_filter = ("status", "pivot_committed", "attention_reason", "legal_hold", "tenant")
    actions = ("legal_hold_on", "legal_hold_off")
    search_fields = ("=id", "goal", "on_behalf_of", "agent__name")
    list_select_related = ("tenant", "agent")
    date_hierarchy = "created_at"

    @admin.display(description="console")
    def timeline(self, obj):
        url = console_url("recovery:run", obj.pk)
        return format_html('<a href="{}">timeline</a>', url) if url else ""


@admin.register(Action)
class ActionAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "seq", "kind", "tool", "status", "risk", "target_type", "target_id",
                    "idempotency_key", "attempts", "created_at")
    list_filter = ("kind", "status", "risk", "saga_role", "tenant")
    search_fields = ("=id", "=run__id", "idempotency_key", "target_id", "tool__name")
    list_select_related = ("tool",)
    date_hierarchy = "created_at"
    raw_id_fields = ("run", "compensates", "tool")


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "action_id", "number", "worker", "outcome", "latency_ms", "error_class", "started_at",
                    "finished_at")
    list_filter = ("outcome", "error_class")
    search_fields = ("=action__id", "worker", "error_message")
    raw_id_fields = ("action",)


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "label", "created_at")
    list_filter = ("label", "tenant")
    search_fields = ("=run__id", "label")
    raw_id_fields = ("run",)


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "seq", "kind", "actor", "run_ref", "action_ref", "created_at", "short_hash")
    list_filter = ("tenant", "kind")
    search_fields = ("kind", "actor", "=run_ref", "=action_ref", "hash")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"

    @admin.display(description="hash")
    def short_hash(self, obj):
        return obj.hash[:12]


@admin.register(AuditHead)
class AuditHeadAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "seq", "hash")
    search_fields = ("tenant__slug",)
    list_select_related = ("tenant",)
