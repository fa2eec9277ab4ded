from django.urls import path

from sandbox import views
from sandbox.models import ToolName

app_name = "sandbox"

# Fixed paths come before the `<record_id>` readers that share their prefix.
urlpatterns = [
    path("hr/users", views.tool_endpoint(ToolName.HR_CREATE_USER), name="hr-create-user"),
    path("hr/users/delete", views.tool_endpoint(ToolName.HR_DELETE_USER), name="hr-delete-user"),
    path("hr/users/<str:record_id>", views.record_endpoint("users", "user"), name="hr-user"),
    path("licenses/provision", views.tool_endpoint(ToolName.LICENSES_PROVISION), name="licenses-provision"),
    path("licenses/revoke", views.tool_endpoint(ToolName.LICENSES_REVOKE), name="licenses-revoke"),
    path("licenses/<str:record_id>", views.record_endpoint("licenses", "license"), name="license"),
    path("email/send", views.tool_endpoint(ToolName.EMAIL_SEND), name="email-send"),
    path("email/messages", views.messages, name="email-messages"),
    path("email/messages/<str:record_id>", views.record_endpoint("messages", "message"), name="email-message"),
    path("payments/charge", views.tool_endpoint(ToolName.PAYMENTS_CHARGE), name="payments-charge"),
    path("payments/refund", views.tool_endpoint(ToolName.PAYMENTS_REFUND), name="payments-refund"),
    path("payments/charges/<str:record_id>", views.record_endpoint("charges", "charge"), name="payments-charge-detail"),
    path("travel/flights/book", views.tool_endpoint(ToolName.TRAVEL_BOOK_FLIGHT), name="travel-book-flight"),
    path("travel/flights/cancel", views.tool_endpoint(ToolName.TRAVEL_CANCEL_FLIGHT), name="travel-cancel-flight"),
    path("travel/flights/<str:record_id>", views.record_endpoint("flights", "flight booking"), name="travel-flight"),
    path("travel/hotels/reserve", views.tool_endpoint(ToolName.TRAVEL_RESERVE_HOTEL), name="travel-reserve-hotel"),
    path("travel/hotels/cancel", views.tool_endpoint(ToolName.TRAVEL_CANCEL_HOTEL), name="travel-cancel-hotel"),
    path("travel/hotels/<str:record_id>", views.record_endpoint("hotels", "hotel reservation"), name="travel-hotel"),
    path("crm/tickets", views.tickets, name="crm-tickets"),
    path("crm/tickets/update", views.tool_endpoint(ToolName.CRM_UPDATE_TICKET), name="crm-update-ticket"),
    path("crm/tickets/<str:record_id>", views.record_endpoint("tickets", "ticket"), name="crm-ticket"),
    path("state", views.state, name="state"),
    path("reset", views.reset, name="reset"),
    path("calls", views.calls, name="calls"),
    path("faults", views.faults, name="faults"),
    path("faults/clear", views.faults_clear_view, name="faults-clear"),
]
