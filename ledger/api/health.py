"""`/healthz`: is the database reachable, and is a worker taking the queued work?

The worker is judged from what any web process can see: the queue of the broker in use (the ORM queue, or
Redis's list when Redis is the broker): work that has waited longer than STALE_AFTER means no worker is taking
it (stale); otherwise a django-q2 cluster heartbeat (when the broker shares its stats) or a task history means
one is (ok); neither means none was ever seen (none). A Redis broker that does not answer is reported as such.
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.db import DatabaseError, connection
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.redis_broker import Redis as RedisBroker
from django_q.models import OrmQ, Task
from django_q.signing import SignedPackage
from django_q.status import Stat
from redis.exceptions import RedisError
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


class BrokerUnreachable(Exception):
    pass


def queue_backlog(now) -> tuple[str, int, object]:
    """The broker in use, how many tasks wait in it, and when the oldest of them was queued (None: none waits).

    Redis: the length of the cluster's list and the `started` stamp django-q2 puts in each task it queues, read from
    the list's head (the next to be taken), its signature checked. ORM: the rows due now."""
    broker = get_broker()
    if isinstance(broker, RedisBroker):
        try:
            queued = broker.queue_size()
            head = broker.connection.lindex(broker.list_key, 0)
        except RedisError as exc:
            raise BrokerUnreachable(str(exc)) from None
        oldest = SignedPackage.loads(head).get("started") if head else None
        return "redis", queued, oldest
    oldest = OrmQ.objects.filter(lock__lte=now).order_by("lock").values_list("lock", flat=True).first()
    return "orm", OrmQ.objects.filter(lock__lte=now).count(), oldest


def worker_state() -> dict:
    now = timezone.now()
    broker, queued, oldest = queue_backlog(now)
    waited = (now - oldest).total_seconds() if oldest else 0.0
    last = Task.objects.order_by("-stopped").values_list("stopped", flat=True).first()
    if oldest is not None and now - oldest > STALE_AFTER:
        state = "stale"
    elif cluster_heartbeat(now) or last is not None:
        state = "ok"
    else:
        state = "none"
    return {"state": state, "broker": broker, "queued": queued, "oldest_wait_seconds": round(max(0.0, waited), 3),
            "last_task_at": last}


class WorkerOut(serializers.Serializer):
    state = serializers.ChoiceField(["ok", "stale", "none"])
    broker = serializers.ChoiceField(["orm", "redis"], help_text="The broker the worker takes tasks from.")
    queued = serializers.IntegerField(help_text="Tasks waiting in the broker's queue.")
    oldest_wait_seconds = serializers.FloatField()
    last_task_at = serializers.DateTimeField(allow_null=True)


class HealthOut(serializers.Serializer):
    status = serializers.ChoiceField(["ok", "degraded", "down"])
    database = serializers.ChoiceField(["ok", "unreachable"])
    worker = serializers.ChoiceField(["ok", "stale", "none", "unknown"])
    worker_detail = WorkerOut(allow_null=True)
    broker = serializers.ChoiceField(["unreachable"], required=False,
                                     help_text="Present when the broker (Redis) does not answer: nothing can be queued.")


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
        except BrokerUnreachable as exc:
            log.warning("healthz: the broker does not answer: %s", exc)
            return Response({"status": "degraded", "database": "ok", "worker": "unknown", "worker_detail": None,
                             "broker": "unreachable"})
        return Response({"status": "ok" if worker["state"] == "ok" else "degraded", "database": "ok",
                         "worker": worker["state"], "worker_detail": worker})
