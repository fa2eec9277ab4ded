"""The ASGI application: what the production command serves (docs/production.md: `gunicorn config.asgi -k
config.http_worker.Worker`).

Under ASGI the waits (ledger/api/waits.py) are awaited on each web process's event loop instead of holding a worker
or a thread: a view that would wait answers a `pending` placeholder, which goes back through the middleware like any
response, and `Handler.send_response` waits for its step before it sends the answer. Each request's synchronous
code (middleware, views) runs in a thread the request has to itself until it ends (or, for a wait, until its
synchronous code is done), one of the process's idle request threads (config/request_threads.py). So two things
about database connections are set here, for the web server only:

- With UNWIND_DB_POOL (PostgreSQL), connections come from a pool of that size per process: a burst of requests
  waits for a connection instead of opening one each until PostgreSQL refuses everyone. Only here, not in the
  settings every process reads: the worker (django-q2) forks its cluster, and a pool's connections and threads do
  not survive a fork.
- Without a pool, a request thread's connection would outlive the request (CONN_MAX_AGE keeps it for the thread's
  next request, however long that takes): it is closed when the request ends, so that an idle thread holds none.
  The inline pool's threads and the waits' keep theirs for CONN_MAX_AGE as before.
"""
import os

from django.conf import settings
import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
_database = settings.DATABASES["default"]
if settings.UNWIND_DB_POOL and _database["ENGINE"].endswith("postgresql"):
    _database["CONN_MAX_AGE"] = 0  # a connection goes back to the pool when its thread is done with it
    _database["OPTIONS"]["pool"] = {"min_size": min(2, settings.UNWIND_DB_POOL), "max_size": settings.UNWIND_DB_POOL,
                                    "timeout": settings.UNWIND_DB_POOL_TIMEOUT}
django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application does

from asgiref.sync import ThreadSensitiveContext, sync_to_async  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402 - after the settings are loaded
from django.core.signals import request_finished  # noqa: E402
from django.db import connections  # noqa: E402

from config.request_threads import RequestLane, RequestThreads  # noqa: E402
from ledger.api import waits  # noqa: E402


class Handler(ASGIHandler):
    """Django's ASGI handler, which waits for the step of a `pending` response on the event loop before it sends its
    answer (`waits.answered_on_loop`). The middleware stay synchronous, and every request runs them in one thread,
    once: a wait done in an asynchronous view instead would have every middleware hop between that thread and the
    loop twice (Django's `MiddlewareMixin`), which every other request would pay for too."""

    threads = RequestThreads()

    def load_middleware(self, is_async=False):
        """The middleware chain Django builds for a WSGI server, views included, called in the request's thread in
        one hop from the loop. Django's ASGI chain ends in an asynchronous handler instead, so below the innermost
        synchronous middleware each request hopped from its thread to the loop (`async_to_sync`) and back to its
        thread for the view (`sync_to_async`): two crossings of the loop per request, however few the synchronous
        middleware (issue 40)."""
        super().load_middleware(is_async=False)
        self._middleware_chain = sync_to_async(self._middleware_chain, thread_sensitive=True)

    async def __call__(self, scope, receive, send):
        """Django's own, but the request's thread is one of the process's idle ones (config/request_threads.py)
        rather than one started for it and joined by another after it."""
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        lane = RequestLane(self.threads)
        try:
            async with ThreadSensitiveContext(executor=lane):
                await self.handle(scope, receive, send)
        finally:
            lane.let_go()

    async def run_get_response(self, request):
        response = await super().run_get_response(request)
        if getattr(response, "pending", None) is not None:
            response.pending.request = request
        return response

    async def send_response(self, response, send):
        if getattr(response, "pending", None) is not None:
            response = await waits.answered_on_loop(response)
        await super().send_response(response, send)


application = Handler()


def close_the_requests_connections(sender, **kwargs):
    """Sent in the request's own thread when its response is closed (or the client left)."""
    connections.close_all()


request_finished.connect(close_the_requests_connections, sender=ASGIHandler,
                         dispatch_uid="unwind-asgi-request-connections")
