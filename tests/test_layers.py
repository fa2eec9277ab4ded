"""The layout is the architecture: imports run one way, and the ledger knows nothing of the apps built on it.

Read from the source with `ast`, lazy imports inside functions and imports for type checkers included: a circle
hidden in a function body is still a circle a reader has to untangle (docs/architecture.md draws the layers). Inside
the ledger, imports run down its floors (LEDGER_FLOORS), never up.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("config", "ledger", "approvals", "recovery", "sandbox", "mcp_gateway", "unwind_client")
# The apps built on the ledger; the ledger reaches them only through events and settings (ledger/events.py,
# ledger/api/links.py), never by importing them.
ABOVE_THE_LEDGER = ("approvals", "recovery", "sandbox", "mcp_gateway", "config")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(filter(None, (owner(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else owner(node.module))
    found.discard(None)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back_through_others():
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_ledger_imports_none_of_the_apps_built_on_it():
    wrong = {(name, target) for name, targets in graph().items() if name.split(".")[0] == "ledger"
             for target in targets if target.split(".")[0] in ABOVE_THE_LEDGER}
    assert wrong == set()


# Inside the ledger, floors, lowest first: a module imports only from its own floor or the floors below it (within a
# floor, packages may import each other, and the circle test above keeps that from closing a loop). Every part of
# ledger/ is named here, so a new module or package has to be given its floor (docs/architecture.md draws them).
LEDGER_FLOORS = (
    # the ground floor: no models, no services; db/ holds the raw SQL the hot paths need and the helpers that read
    # its rows back (sql, mapping, received)
    ("ledger", "ledger.errors", "ledger.canonical", "ledger.agent_text", "ledger.log_redaction", "ledger.csp",
     "ledger.web_messages", "ledger.tracing_provider", "ledger.db"),
    ("ledger.models", "ledger.events", "ledger.tracing"),
    # what a step is allowed to do, what calls its tool, what records it
    ("ledger.policy", "ledger.executors", "ledger.audit", "ledger.archive"),
    # a step's life, tenants and agents
    ("ledger.engine", "ledger.tenancy"),
    # the doors: the agent API, the admin, Django's entry points
    ("ledger.api", "ledger.admin", "ledger.tasks", "ledger.urls", "ledger.apps", "ledger.management",
     "ledger.templatetags"),
)


def floor_of(module: str, floors=LEDGER_FLOORS) -> int | None:
    """The floor of a ledger module: that of the longest name in LEDGER_FLOORS it is, or is inside of (`ledger`
    itself names only ledger/__init__.py)."""
    best = None
    for number, names in enumerate(floors):
        for name in names:
            inside = "." in name and module.startswith(name + ".")
            if (module == name or inside) and (best is None or len(name) > len(best[1])):
                best = (number, name)
    return best[0] if best else None


def upward(edges: dict[str, set[str]], floors=LEDGER_FLOORS) -> set[tuple[str, str]]:
    """Imports inside the ledger from a lower floor to a higher one."""
    return {(name, target) for name, targets in edges.items() if name.split(".")[0] == "ledger"
            for target in targets if target.split(".")[0] == "ledger" and floor_of(target, floors) > floor_of(name, floors)}


def test_every_part_of_the_ledger_has_a_floor():
    assert {name for name in modules() if name.split(".")[0] == "ledger" and floor_of(name) is None} == set()


def test_no_import_inside_the_ledger_points_upward():
    assert upward(graph()) == set()


def test_the_floor_check_finds_an_upward_import():
    floors = (("ledger.db",), ("ledger.policy",), ("ledger.api",))
    edges = {"ledger.policy.versions": {"ledger.api.selectors", "ledger.db.sql"}, "ledger.api.runs": {"ledger.db"},
             "ledger.db.sql": set()}
    assert upward(edges, floors) == {("ledger.policy.versions", "ledger.api.selectors")}


def test_the_client_imports_nothing_of_the_service():
    wrong = {(name, target) for name, targets in graph().items() if name.startswith("unwind_client")
             for target in targets if not target.startswith("unwind_client")}
    assert wrong == set()


LIMIT = 500  # lines; a longer module says why in its docstring ("Longer than 500 lines: ...")


def test_no_module_is_longer_than_500_lines_without_saying_why():
    unexplained = {}
    for name, path in modules().items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > LIMIT and "Longer than 500 lines:" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained[name] = lines
    assert unexplained == {}
