app_name = "recovery"

urlpatterns = []
