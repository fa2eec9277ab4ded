"""A transactional test leaves nothing for the next, the content types and permissions included.

On PostgreSQL the teardown (tests/conftest.py `_delete_what_a_test_wrote`) keeps those two tables when they hold what
post_migrate last made of them, and skips the receivers that would make them again; a test that added, changed or
deleted a row there gets them made afresh. pytest runs a module's tests in order: after the first test's teardown
the tables are as post_migrate made them, the second changes them, the third checks they were made again.
"""
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType


def test_a_test_that_leaves_them_as_they_were(transactional_db):
    assert Permission.objects.filter(codename="add_user", name="Can add user").exists()


def test_a_test_adds_a_content_type_and_a_permission_renames_one_and_deletes_one(transactional_db):
    added = ContentType.objects.create(app_label="probe", model="thing")
    Permission.objects.create(codename="probe_thing", name="Can probe", content_type=added)
    assert Permission.objects.filter(codename="add_user").update(name="Can add a stranger") == 1
    assert Permission.objects.filter(codename="view_user").delete()[0] == 1


def test_the_next_test_finds_them_as_post_migrate_makes_them(transactional_db):
    assert not ContentType.objects.filter(app_label="probe").exists()
    assert not Permission.objects.filter(codename="probe_thing").exists()
    assert Permission.objects.get(codename="add_user").name == "Can add user"
    assert Permission.objects.filter(codename="view_user", content_type__model="user").exists()
