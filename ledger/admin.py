"""Admin for the ledger: tenants, members and tool policy are edited here; ledger and audit rows are only read.

State changes to runs, actions and the audit chain go through the services (and the console), never
through a form: an edit here would also break the audit chain's fingerprints.
"""
from django.contrib import admin, messages
from django.forms.models import model_to_dict
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html

from ledger.audit import ledger_transaction
from ledger.canonical import digest
from ledger.models import Action, Agent, Attempt, AuditEvent, AuditHead, Checkpoint, Membership, Run, Tenant, Tool
from ledger.services.tenancy import agent_revoke, membership_set, tenant_create

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


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "approval_threshold", "approval_ttl_seconds", "created_at")
    list_filter = ("approval_threshold",)
    search_fields = ("slug", "name")
    readonly_fields = ("created_at",)

    def get_readonly_fields(self, request, obj=None):
        return ("slug", "created_at") if obj is not None else ("created_at",)

    def has_delete_permission(self, request, obj=None):
        return False  # a tenant's audit chain must outlive its rows (AuditEvent protects it anyway)

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        # A new tenant needs its audit chain head and its first event: the service makes both.
        created = tenant_create(slug=obj.slug, name=obj.name, actor=actor_of(request))
        Tenant.objects.filter(pk=created.pk).update(approval_threshold=obj.approval_threshold,
                                                    approval_ttl_seconds=obj.approval_ttl_seconds)
        obj.pk, obj.created_at = created.pk, created.created_at
        obj._state.adding = False


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ("name", "tenant", "key_prefix", "created_at", "revoked_at")
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "key_prefix", "tenant__slug")
    fields = ("tenant", "name", "key_prefix", "created_at", "revoked_at")
    readonly_fields = fields
    list_select_related = ("tenant",)
    actions = ("revoke",)
    help_text = ("Agents are created only with the command `manage.py create_agent TENANT NAME`, which prints the API "
                 "key once; only its hash is stored, and only its prefix is shown here.")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request):
        return request.user.has_perm("ledger.change_agent")

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {"subtitle": self.help_text, **(extra_context or {})})

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return super().change_view(request, object_id, form_url, {"subtitle": self.help_text, **(extra_context or {})})

    @admin.action(description="Revoke the selected agents' API keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        revoked = 0
        for agent in queryset.filter(revoked_at__isnull=True):
            agent_revoke(agent=agent, actor=actor_of(request))
            revoked += 1
        self.message_user(request, f"{revoked} agent key(s) revoked.", messages.SUCCESS)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
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


@admin.register(Tool)
class ToolAdmin(admin.ModelAdmin):
    """Tool policy is editable here; each save is recorded in the tenant's audit chain."""

    list_display = ("name", "tenant", "action_class", "saga_role", "risk", "approval", "executor", "updated_at")
    list_filter = ("tenant", "action_class", "saga_role", "risk", "approval", "executor")
    search_fields = ("name", "description", "endpoint")
    list_select_related = ("tenant",)
    readonly_fields = ("created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("tenant", "name", "description")}),
        ("Policy", {"fields": ("action_class", "saga_role", "risk", "approval", "approvals_required")}),
        ("Execution", {"fields": ("executor", "endpoint", "timeout_seconds", "max_attempts", "backoff_seconds",
                                  "honours_idempotency_key", "key_fields")}),
        ("Target, snapshots and verification", {"fields": ("target_type", "target_from", "snapshot", "verify", "lookup")}),
        ("Arguments and compensation", {"fields": ("args_schema", "compensation")}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    def save_model(self, request, obj, form, change):
        with ledger_transaction(obj.tenant_id) as audit:
            super().save_model(request, obj, form, change)
            policy = {k: v for k, v in model_to_dict(obj).items() if k not in ("id", "tenant")}
            audit.record("tool.updated" if change else "tool.registered", actor=actor_of(request), tool=obj.name,
                         policy=digest(policy), via="admin", rows=[obj])


def console_url(url_name: str, pk: int) -> str:
    """A link into the operator console, or nothing where the console is not installed."""
    try:
        return reverse(url_name, args=[pk])
    except NoReverseMatch:
        return ""


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "agent", "status", "pivot_committed", "attention_reason", "created_at",
                    "finished_at", "timeline")
    list_filter = ("status", "pivot_committed", "attention_reason", "tenant")
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
