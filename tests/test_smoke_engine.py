from tests.helpers import act, fault, open_run


def test_onboarding_unwinds_newest_first(tools):
    run = open_run(tools, goal="Onboard Ashu")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    assert user.status == "succeeded", (user.error_message, user.verification)
    lic = act(run, "licenses.provision", {"user_id": user.result["id"]})
    assert lic.status == "succeeded"
    fault("email.send", "status", status=504, times=0)
    mail = act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    assert mail.status == "failed", mail.status
    run.refresh_from_db()
    assert run.status == "compensated", (run.status, run.attention_detail)
