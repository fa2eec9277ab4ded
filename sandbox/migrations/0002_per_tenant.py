"""Every sandbox row belongs to a tenant: each tenant gets its own world, faults, keys and call log.

The sandbox holds demo and test data only, and rows written before this migration cannot be told apart
by tenant, so they are dropped (`manage.py sandbox_reset --tenant <slug>` seeds a tenant's world again).
Tickets are numbered by their clients ("T-182"), so the number stops being the primary key and becomes
unique per tenant; the table is rebuilt, which is why it is deleted and created rather than altered.
"""
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

WORLD = ("ToolCall", "IdempotencyRecord", "Fault", "DirectoryUser", "License", "Message", "Charge", "FlightBooking",
         "HotelReservation")


def forget_untenanted_rows(apps, schema_editor):
    for name in (*WORLD, "Ticket"):
        apps.get_model("sandbox", name).objects.all().delete()


def tenant_field(*, null: bool):
    return models.ForeignKey(null=null, on_delete=django.db.models.deletion.CASCADE, related_name="+",
                             to="ledger.tenant")


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0001_initial"),
        ("sandbox", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(forget_untenanted_rows, migrations.RunPython.noop),
        migrations.RemoveConstraint(model_name="idempotencyrecord", name="sandbox_idempotency_tool_key_unique"),
        *(migrations.AddField(model_name=name.lower(), name="tenant", field=tenant_field(null=True)) for name in WORLD),
        *(migrations.AlterField(model_name=name.lower(), name="tenant", field=tenant_field(null=False))
          for name in WORLD),
        migrations.AddConstraint(
            model_name="idempotencyrecord",
            constraint=models.UniqueConstraint(fields=("tenant", "tool", "key"),
                                               name="sandbox_idempotency_tool_key_unique"),
        ),
        migrations.DeleteModel(name="Ticket"),
        migrations.CreateModel(
            name="Ticket",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("number", models.CharField(max_length=32)),
                ("subject", models.CharField(max_length=300)),
                ("priority", models.CharField(choices=[("low", "Low"), ("normal", "Normal"), ("high", "High"),
                                                       ("urgent", "Urgent")], default="normal", max_length=16)),
                ("status", models.CharField(choices=[("open", "Open"), ("pending", "Pending"), ("closed", "Closed")],
                                            default="open", max_length=16)),
                ("notes", models.JSONField(blank=True, default=list)),
                ("version", models.PositiveIntegerField(default=1)),
                ("updated_by", models.CharField(max_length=200)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("tenant", tenant_field(null=False)),
            ],
            options={
                "constraints": [
                    models.CheckConstraint(condition=models.Q(("priority__in", ["low", "normal", "high", "urgent"])),
                                           name="sandbox_ticket_priority_valid"),
                    models.CheckConstraint(condition=models.Q(("status__in", ["open", "pending", "closed"])),
                                           name="sandbox_ticket_status_valid"),
                    models.UniqueConstraint(fields=("tenant", "number"),
                                            name="sandbox_ticket_number_unique_per_tenant"),
                ],
            },
        ),
    ]
