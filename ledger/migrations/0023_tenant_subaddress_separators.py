"""Issue 39, finding 9: `subaddress_separators`, a tenant default (and in its versions): the characters that start a
sub-address (`alice+tag@example.com`), which then names alice@example.com's mailbox when telling a requester from
an approver (approvals/addresses.py). "+" for every tenant, existing ones included: a run for `alice+x@…` could be
approved by alice. Versions recorded before hold "+" too, which keeps the field out of their fingerprint
(ledger/audit/chain.py, ADDED_LATER), so they verify as recorded.
"""
import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0022_limit_totals'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='subaddress_separators',
            field=models.CharField(blank=True, db_default='+', default='+', help_text='Characters that start a sub-address in a local part (alice+tag@…), which is then the same mailbox as alice@… when telling a requester from an approver; empty: none.', max_length=4, validators=[django.core.validators.RegexValidator('^[\\+\\-=_]*$', 'only the characters + - = _ (or nothing)')]),
        ),
        migrations.AddField(
            model_name='tenantpolicyversion',
            name='subaddress_separators',
            field=models.CharField(blank=True, db_default='+', default='+', max_length=4),
        ),
    ]
