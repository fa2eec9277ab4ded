"""`/healthz`: is the database reachable, and is a worker taking the queued work?

The worker is judged from what any web process can see: a django-q2 cluster heartbeat when the
broker shares its stats (Redis, or a shared cache), otherwise the ORM queue itself: work that has
waited longer than STALE_AFTER means no worker is taking it (stale); a task history with nothing
overdue means one is (ok); no history and no heartbeat means none was ever seen (none).
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.db import DatabaseError, connection
from django.utils import timezone
from django_q.models import OrmQ, Task
from django_q.status import Stat
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

from ledger.api.base import ApiView

log = logging.getLogger("unwind.api")
STALE_AFTER = timedelta(seconds=60)


def database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone() == (1,)
    except DatabaseError:
        return False


def cluster_heartbeat(now) -> bool:
    try:
        stats = Stat.get_all()
    except Exception as exc:  # noqa: BLE001 - an unreachable broker is "no heartbeat", not a crash
        log.info("no cluster stats: %s", exc)
        return False
    return any(stat.timestamp and now - stat.timestamp < STALE_AFTER for stat in stats)


def worker_state() -> dict:
    now = timezone.now()
    oldest = OrmQ.objects.filter(lock__lte=now).order_by("lock").values_list("lock", flat=True).first()
    waited = (now - oldest).total_seconds() if oldest else 0.0
    last = Task.objects.order_by("-stopped").values_list("stopped", flat=True).first()
    if oldest is not None and now - oldest > STALE_AFTER:
        state = "stale"
    elif cluster_heartbeat(now) or last is not None:
        state = "ok"
    else:
        state = "none"
    return {"state": state, "queued": OrmQ.objects.filter(lock__lte=now).count(), "oldest_wait_seconds": round(waited, 3),
            "last_task_at": last}


class WorkerOut(serializers.Serializer):
    state = serializers.ChoiceField(["ok", "stale", "none"])
    queued = serializers.IntegerField(help_text="Tasks waiting in the ORM queue.")
    oldest_wait_seconds = serializers.FloatField()
    last_task_at = serializers.DateTimeField(allow_null=True)


class HealthOut(serializers.Serializer):
    status = serializers.ChoiceField(["ok", "degraded", "down"])
    database = serializers.ChoiceField(["ok", "unreachable"])
    worker = serializers.ChoiceField(["ok", "stale", "none", "unknown"])
    worker_detail = WorkerOut(allow_null=True)


class HealthView(ApiView):
    authentication_classes = []
    permission_classes = [AllowAny]
    throttle_classes = []

    @extend_schema(
        tags=["health"], operation_id="healthz", summary="Liveness: database and worker",
        responses={200: OpenApiResponse(HealthOut, description="The database answers (status degraded when no "
                                                               "worker takes queued work)."),
                   503: OpenApiResponse(HealthOut, description="The database does not answer.")},
    )
    def get(self, request):
        if not database_ok():
            return Response({"status": "down", "database": "unreachable", "worker": "unknown",
                             "worker_detail": None}, status=503)
        try:
            worker = worker_state()
        except DatabaseError:
            return Response({"status": "down", "database": "unreachable", "worker": "unknown",
                             "worker_detail": None}, status=503)
        return Response({"status": "ok" if worker["state"] == "ok" else "degraded", "database": "ok",
                         "worker": worker["state"], "worker_detail": worker})
