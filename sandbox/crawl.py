"""A crawler for the pages a person reaches: follow every link and submit every GET form, as a given login.

`make demo-check` runs it as each of the demo's people, and tests/test_crawl.py on a live server; both fail on a
4xx or 5xx, on a link that is not a URL a browser would follow as meant (`??page=2`), and on a form that does not
answer. What a filter, sort or pager link shows is checked where it is known what it should show
(tests/test_crawl.py); here every page is reached and read.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit

import requests

# Not followed: leaving the session, machine surfaces (JSON, MCP, static files, the sandbox's tools) and Django's
# own admin beyond its index (its pages are Django's, and a crawl through every change list proves nothing of ours).
SKIP_PREFIXES = ("/accounts/logout", "/api/", "/mcp", "/static/", "/sandbox/", "/admin/")
PAGE_LIMIT = 500
# Filters, sorts and pagers keep each other (`querystring`), so their combinations multiply: each one alone and
# any two together are visited, three or more are not (each pair is where one could undo another).
MAX_COMBINED = 2


def visit_key(url: str) -> tuple | None:
    """What makes two URLs the same page to visit (the order of the query and its empty values do not), or None
    when the URL combines more filters than are worth visiting."""
    parts = urlsplit(url)
    query = tuple(sorted((name, value) for name, value in parse_qsl(parts.query, keep_blank_values=True) if value))
    return None if len(query) > MAX_COMBINED else (parts.path, query)


class Links(HTMLParser):
    """Every URL a page offers to a GET: a[href], [hx-get], and GET forms with each choice of their selects."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.forms: list[dict] = []
        self._form: dict | None = None
        self._select: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and attrs.get("href") is not None:
            self.urls.append(attrs["href"])
        if attrs.get("hx-get"):
            self.urls.append(attrs["hx-get"])
        if tag == "form":
            method = (attrs.get("method") or "get").lower()
            self._form = {"action": attrs.get("action") or "", "fields": [], "selects": []} if method == "get" else None
            if self._form is not None:
                self.forms.append(self._form)
        elif self._form is not None and tag == "input" and attrs.get("name"):
            kind = (attrs.get("type") or "text").lower()
            if kind in ("checkbox", "radio") and "checked" not in attrs:
                return
            if kind not in ("submit", "button", "image", "file"):
                self._form["fields"].append((attrs["name"], attrs.get("value") or ""))
        elif self._form is not None and tag == "select" and attrs.get("name"):
            self._select = {"name": attrs["name"], "options": [], "selected": None}
            self._form["selects"].append(self._select)
        elif self._select is not None and tag == "option":
            value = attrs.get("value", "")
            self._select["options"].append(value)
            if "selected" in attrs:
                self._select["selected"] = value

    def handle_endtag(self, tag):
        if tag == "form":
            self._form = None
        elif tag == "select":
            self._select = None


def form_urls(form: dict, page_url: str) -> list[str]:
    """The form submitted as it stands, then once for each choice of each of its selects."""
    action = urljoin(page_url, form["action"] or page_url).split("?")[0]
    chosen = {s["name"]: s["selected"] if s["selected"] is not None else (s["options"] or [""])[0]
              for s in form["selects"]}
    urls = [f"{action}?{urlencode([*form['fields'], *chosen.items()])}"]
    for select in form["selects"]:
        for option in select["options"]:
            urls.append(f"{action}?{urlencode([*form['fields'], *{**chosen, select['name']: option}.items()])}")
    return urls


@dataclass
class Crawl:
    pages: dict[str, int] = field(default_factory=dict)  # url -> status
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def login(base_url: str, username: str, password: str) -> requests.Session:
    session = requests.Session()
    url = f"{base_url}/accounts/login/"
    session.get(url, timeout=10)
    answer = session.post(url, data={"username": username, "password": password,
                                     "csrfmiddlewaretoken": session.cookies.get("csrftoken", "")},
                          headers={"Referer": url}, timeout=10, allow_redirects=False)
    if answer.status_code != 302:
        raise RuntimeError(f"{username} could not log in ({answer.status_code})")
    return session


def crawl(base_url: str, session: requests.Session, *, start: tuple[str, ...] = ("/",), limit: int = PAGE_LIMIT) -> Crawl:
    """Visit every page reachable from `start` on `base_url`; every problem is a sentence naming the page."""
    result = Crawl()
    host = urlsplit(base_url).netloc
    queue = deque((urljoin(base_url, path), "the start") for path in start)
    seen = {visit_key(url) for url, _ in queue}
    forms_seen: set[tuple] = set()
    while queue and len(result.pages) < limit:
        url, found_on = queue.popleft()
        answer = session.get(url, timeout=20, allow_redirects=True)
        result.pages[url] = answer.status_code
        if answer.status_code >= 400:
            result.problems.append(f"{url} answers {answer.status_code} (linked from {found_on})")
            continue
        if "text/html" not in answer.headers.get("Content-Type", ""):
            continue
        page = Links()
        page.feed(answer.text)
        offered = list(page.urls)
        for form in page.forms:
            if "??" in form["action"]:
                result.problems.append(f"a form on {url} submits to {form['action']!r}")
            which = (urljoin(answer.url, form["action"] or answer.url).split("?")[0],
                     tuple(name for name, _ in form["fields"]), tuple(s["name"] for s in form["selects"]))
            if which not in forms_seen:  # a form is submitted with each of its choices once, where it is first met
                forms_seen.add(which)
                offered += form_urls(form, answer.url)
        for raw in offered:
            if "??" in raw:
                result.problems.append(f"{url} links to {raw!r}")
                continue
            if raw.startswith(("#", "mailto:", "javascript:")) or not raw.strip():
                continue
            target = urljoin(answer.url, raw).split("#")[0]
            parts = urlsplit(target)
            if parts.netloc != host or parts.path.startswith(SKIP_PREFIXES) and parts.path != "/admin/":
                continue
            key = visit_key(target)
            if key is not None and key not in seen:
                seen.add(key)
                queue.append((target, url))
    if queue:
        result.problems.append(f"more than {limit} pages: {len(queue)} not visited (raise the limit)")
    return result
