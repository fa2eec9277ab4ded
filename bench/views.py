"""The baseline the API's cost per action is measured against."""
from rest_framework.response import Response

from ledger.api.auth import IsAgent
from ledger.api.base import ApiView


class NoopView(ApiView):
    """Same base class, authentication (agent key), throttle, parser and renderer as the propose endpoint;
    it parses the body and answers, touching nothing else."""

    permission_classes = [IsAgent]

    def post(self, request):
        return Response({"tool": request.data.get("tool"), "ok": True}, status=201)
