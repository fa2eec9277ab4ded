"""Django's four password checks guard every form that sets a password (here: an admin adding a person)."""
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

ADD_USER = "/admin/auth/user/add/"


@pytest.fixture
def admin_client(db):
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "unused-Pass-17"))
    return client


def add_user(client: Client, username: str, password: str):
    return client.post(ADD_USER, {"username": username, "password1": password, "password2": password,
                                  "usable_password": "true"})


@pytest.mark.parametrize("password, refusal", [
    ("short-7A", "This password is too short. It must contain at least 12 characters."),
    ("password1234", "This password is too common."),
    ("802394718234", "This password is entirely numeric."),
    ("dana.newhire2026", "The password is too similar to the username."),
])
def test_a_weak_password_is_refused_and_no_person_is_created(admin_client, password, refusal):
    response = add_user(admin_client, "dana.newhire2026", password)
    assert response.status_code == 200
    assert refusal in response.content.decode()
    assert not get_user_model().objects.filter(username="dana.newhire2026").exists()


def test_a_strong_password_is_accepted(admin_client):
    response = add_user(admin_client, "dana", "violet-Harbour-lantern-42")
    assert response.status_code == 302
    assert get_user_model().objects.get(username="dana").check_password("violet-Harbour-lantern-42")
