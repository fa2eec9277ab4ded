"""The one model of legal moves: for a run in its state, what each actor may do next, and what each move will do.

Every surface that offers a person or an agent a button, a link or a tool (the console, the approval pages, the
trail's share page, emails, Slack, the API, MCP) asks `run_moves` which moves there are, offers exactly the allowed
ones, and says before the click what each will do (`Move.consequences`, the plan the engine then runs). The engine's
own decisions (`run_resume`, `run_compensate`, `run_close`, a hold's stop, a rejection, a cancel) call `require` under
their locks, so a move the model does not offer is refused with its sentence (409) and nothing changes.

The saga law decides every answer here:
- once any forward step has begun to be undone, the forward path is closed: a run in that state is never resumed
  (its moves are to retry the failed undos, or to close it, having finished them by hand);
- before the pivot, a stop, a rejection or a cancel unwinds the run: every earlier step that can be undone is undone,
  newest first, and every step still waiting is called off;
- after the pivot nothing before it is undone by those moves: the stopped or rejected step alone is left out (a
  rejection or a cancel then puts the run before a person).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ledger.db.partitions import recent
from ledger.engine import attempts
from ledger.models import RUN_FINAL, Action, ActionKind, ActionStatus as A, Run, RunStatus as R

AGENT, APPROVER, OPERATOR, CUSTOMER = "agent", "approver", "operator", "customer"
# Forward steps in these statuses mean the run has begun to be undone: the forward path is closed.
UNDOING = (A.COMPENSATING, A.COMPENSATED, A.COMPENSATION_FAILED)
# What happens to a step as a consequence of a move.
UNDO, CALL_OFF, RETRY, RESEND, STOP, DECLINE, LEFT_STANDING = (
    "undo", "call_off", "retry", "resend", "stop", "decline", "left_standing")


@dataclass(frozen=True)
class Consequence:
    """One step a move touches, and how."""

    effect: str
    action: Action

    @property
    def staff_words(self) -> str:
        verb = {UNDO: "undo", CALL_OFF: "call off", RETRY: "retry", RESEND: "send again", STOP: "stop",
                DECLINE: "decline", LEFT_STANDING: "leave standing"}[self.effect]
        return f"{verb} step {self.action.seq} ({self.action.tool.name})"


@dataclass(frozen=True)
class Move:
    actor: str
    name: str
    allowed: bool
    refusal: str = ""
    consequences: tuple[Consequence, ...] = ()
    action_id: int | None = None
    label: str = ""

    def touching(self, *effects: str) -> list[Action]:
        return [c.action for c in self.consequences if c.effect in effects]

    @property
    def undoes(self) -> list[Action]:
        """The steps this move undoes, newest first."""
        return self.touching(UNDO)

    @property
    def staff_words(self) -> str:
        """What the move will do, for staff: "This will undo step 2 (travel.book_flight) and call off step 4 (…)"."""
        parts = [c.staff_words for c in self.consequences]
        if not parts:
            return ""
        return "This will " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + "."


@dataclass
class RunMoves:
    run: Run
    actions: list[Action]
    moves: list[Move] = field(default_factory=list)

    def get(self, actor: str, name: str, action_id: int | None = None) -> Move:
        for move in self.moves:
            if move.actor == actor and move.name == name and (action_id is None or move.action_id == action_id):
                return move
        what = f"{name} step {action_id}" if action_id is not None else name
        return Move(actor, name, False, refusal=f"run {self.run.pk} offers no move '{what}' to the {actor}",
                    action_id=action_id)

    def allowed(self, actor: str) -> list[Move]:
        return [move for move in self.moves if move.actor == actor and move.allowed]


# --- what the law says about the run's steps ------------------------------------------------------------------

def forward_steps(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.kind == ActionKind.FORWARD]


def forward_closed(actions: list[Action]) -> Action | None:
    """The first forward step that has begun to be undone, or None: while there is one, the run never goes forward."""
    return next((a for a in forward_steps(actions) if a.status in UNDOING), None)


def unwind_plan(actions: list[Action], *, retry_failed: bool = False) -> list[Action]:
    """The forward steps an unwind of the run would undo now, newest first: those that stand (or are being undone)
    and have an undo (`attempts.compensable`, the unwinder's own test); with `retry_failed`, an operator's compensate,
    also those whose undo failed (it tries them again)."""
    statuses = (A.SUCCEEDED, A.COMPENSATING, *((A.COMPENSATION_FAILED,) if retry_failed else ()))
    return [a for a in reversed(forward_steps(actions)) if a.status in statuses and attempts.compensable(a)]


def waiting_steps(actions: list[Action], *, but: Action | None = None) -> list[Action]:
    """Forward steps that have not started (an unwind or a cancel calls them off)."""
    return [a for a in forward_steps(actions) if a.status in attempts.PENDING and a != but
            and not (a.status == A.RETRY_SCHEDULED and attempts.an_attempt_may_have_acted(a))]


def retry_steps(run: Run, actions: list[Action]) -> list[Action]:
    """The steps a resume retries with their same keys: failed or lost forward steps, except those their tool refused
    (they did nothing and the agent was answered), limited to the last checkpoint's pending steps when it names any."""
    checkpoint = run.checkpoints.filter(created_at__gte=recent(run.created_at)).order_by("-id").first()
    pending = set(checkpoint.state.get("pending_action_ids", [])) if checkpoint else set()
    steps = [a for a in forward_steps(actions) if a.status in (A.FAILED, A.LOST)
             and not (a.status == A.FAILED and a.error_class == attempts.REFUSED)]
    return [a for a in steps if a.pk in pending] if pending else steps


def stop_consequences(run: Run, actions: list[Action], step: Action) -> tuple[Consequence, ...]:
    """What stopping, declining or cancelling at `step` does to the rest of the run, by the saga law."""
    first = (Consequence(STOP if step.status == A.HELD else DECLINE, step),)
    if run.cancel_requested_at or run.status not in (R.RUNNING, R.AWAITING_APPROVAL):
        return first
    if run.pivot_committed:
        return first
    return first + tuple(Consequence(UNDO, a) for a in unwind_plan(actions)) + tuple(
        Consequence(CALL_OFF, a) for a in waiting_steps(actions, but=step))


def stop_move(run: Run, actions: list[Action], step: Action, actor: str) -> Move:
    """Stopping the held `step` (who may is the caller's question, recovery/stops.py): what it does to the run."""
    return Move(actor, "stop", True, consequences=stop_consequences(run, actions, step), action_id=step.pk,
                label="Stop it")


# --- the moves --------------------------------------------------------------------------------------------------

def run_moves(run: Run, actions: list[Action] | None = None) -> RunMoves:
    """Every move on `run` as it is now, for every actor, each allowed or refused with its sentence."""
    if actions is None:
        actions = list(run.actions.select_related("tool").order_by("seq"))
    moves = RunMoves(run=run, actions=actions)
    moves.moves += _person_moves(run, actions)
    moves.moves += _agent_moves(run, actions)
    for step in forward_steps(actions):
        if step.status == A.HELD:
            moves.moves += [stop_move(run, actions, step, actor) for actor in (OPERATOR, APPROVER, CUSTOMER)]
        if step.status == A.AWAITING_APPROVAL:
            moves.moves.append(Move(APPROVER, "approve", True, action_id=step.pk, label="Approve"))
            moves.moves.append(Move(APPROVER, "reject", True, action_id=step.pk, label="Reject",
                                    consequences=stop_consequences(run, actions, step)))
        if step.status == A.SUCCEEDED and attempts.compensable(step):
            moves.moves.append(Move(CUSTOMER, "ask_undo", True, action_id=step.pk, label="Undo this"))
    for undo in actions:
        if undo.kind == ActionKind.COMPENSATION and undo.status == A.AWAITING_APPROVAL:
            # An undo that waits for a person (a refund above a threshold): approving it undoes its step; rejecting
            # it leaves the step standing, and the run goes before an operator ("compensation failed").
            forward = next((a for a in actions if a.pk == undo.compensates_id), None)
            if forward is None:
                continue
            moves.moves.append(Move(APPROVER, "approve", True, action_id=undo.pk, label="Approve the undo",
                                    consequences=(Consequence(UNDO, forward),)))
            moves.moves.append(Move(APPROVER, "reject", True, action_id=undo.pk, label="Reject the undo",
                                    consequences=(Consequence(LEFT_STANDING, forward),)))
    return moves


def _person_moves(run: Run, actions: list[Action]) -> list[Move]:
    """Resume, compensate and close: a person's decisions on a run that needs attention."""
    if run.status != R.NEEDS_ATTENTION:
        state = run.status.replace("_", " ")
        return [Move(OPERATOR, name, False, refusal=f"run {run.pk} is {state}; only a run that needs attention can be "
                                                   f"{done}") for name, done in RESOLVED_WORDS.items()]
    closed = forward_closed(actions)
    undo = unwind_plan(actions, retry_failed=True)
    failed = [a for a in forward_steps(actions) if a.status == A.COMPENSATION_FAILED]
    lost = [a for a in forward_steps(actions) if a.status == A.LOST]
    compensate = Move(OPERATOR, "compensate", True,
                      consequences=tuple(Consequence(UNDO, a) for a in undo) + tuple(
                          Consequence(CALL_OFF, a) for a in waiting_steps(actions)),
                      label="Undo anyway, overwriting their change" if run.attention_reason == "drift"
                      else "Retry the failed undos" if failed else "Compensate")
    close = Move(OPERATOR, "close", True, label="Mark as finished by hand and close" if closed else "Close",
                 consequences=tuple(Consequence(LEFT_STANDING, a) for a in
                                    [*reversed([a for a in forward_steps(actions) if a.status in (
                                        A.SUCCEEDED, A.COMPENSATION_FAILED)]), *lost]) + tuple(
                     Consequence(CALL_OFF, a) for a in waiting_steps(actions)))
    flying = next((a for a in actions if a.status == A.RUNNING), None)
    if flying is not None:
        # A step still being carried out (a worker's call, or one whose worker was lost and whose lease has not yet
        # ended) lands after the run is final: a closed run would then hold a step done or undone that nobody saw.
        close = Move(OPERATOR, "close", False, refusal=(
            f"run {run.pk} has a step still in flight (step {flying.seq}, {flying.tool.name}): close it once that "
            "step has landed (its call answers, or the sweep takes it over when its lease ends)"))
    if run.cancel_requested_at and not run.pivot_committed:
        resume = Move(OPERATOR, "resume", False, refusal=f"run {run.pk} was cancelled; compensate or close it instead")
    elif closed is not None:
        how = {A.COMPENSATION_FAILED: "could not be undone", A.COMPENSATED: "was undone",
               A.COMPENSATING: "is being undone"}[closed.status]
        resume = Move(OPERATOR, "resume", False, refusal=(
            f"run {run.pk} has begun to be undone (step {closed.seq}, {closed.tool.name}, {how}), so its forward path "
            "is closed: retry the failed undos (compensate) or close it once they are handled by hand"))
    else:
        retry = retry_steps(run, actions)
        resume = Move(OPERATOR, "resume", True, label="Resume",
                      consequences=tuple(Consequence(RESEND if a.status == A.LOST else RETRY, a) for a in retry))
    return [resume, compensate, close]


RESOLVED_WORDS = {"resume": "resumed", "compensate": "compensated", "close": "closed"}


def _agent_moves(run: Run, actions: list[Action]) -> list[Move]:
    moves = []
    if run.cancel_requested_at:
        cancel = Move(AGENT, "cancel", True, label="Cancel")  # a repeat (a client's retry): the run as it is now
    elif run.status in RUN_FINAL:
        cancel = Move(AGENT, "cancel", False, refusal=f"run {run.pk} is already {run.status}; there is nothing to cancel")
    else:
        pending = [a for a in forward_steps(actions) if a.status in attempts.PENDING]
        if run.pivot_committed or run.status in (R.UNWINDING, R.NEEDS_ATTENTION):
            consequences = tuple(Consequence(STOP if a.status == A.HELD else CALL_OFF, a) for a in pending)
        else:
            consequences = tuple(Consequence(UNDO, a) for a in unwind_plan(actions)) + tuple(
                Consequence(STOP if a.status == A.HELD else CALL_OFF, a) for a in pending)
        cancel = Move(AGENT, "cancel", True, label="Cancel", consequences=consequences)
    moves.append(cancel)
    moves.append(complete_move(run, next(((a.seq, a.tool.name, a.status) for a in actions
                                          if a.status in COMPLETE_WAITS_FOR), None)))
    return moves


COMPLETE_WAITS_FOR = (*attempts.PENDING, A.RUNNING)  # a step (forward or undo) in these keeps its run from completing


def complete_move(run: Run, in_flight: tuple[int, str, str] | None) -> Move:
    """The agent's complete on `run`, given its first step in flight (seq, tool name, status), if any: the one rule,
    for the model and for the decision that writes a completion (`runs.completion`, from the steps it holds)."""
    if run.status == R.COMPLETED:
        return Move(AGENT, "complete", True, label="Complete")  # a repeat: answered with the run as it is
    if in_flight is not None:
        seq, tool_name, status = in_flight
        return Move(AGENT, "complete", False, refusal=(
            f"step {seq} ({tool_name}) is still {status.replace('_', ' ')}; wait for it before completing the run"))
    if run.status != R.RUNNING:
        return Move(AGENT, "complete", False,
                    refusal=f"run {run.pk} is {run.status.replace('_', ' ')} and cannot complete")
    return Move(AGENT, "complete", True, label="Complete")


def require(run: Run, actor: str, name: str, *, action_id: int | None = None,
            actions: list[Action] | None = None) -> Move:
    """The move, when the model offers it; StateConflict with the model's sentence when it does not."""
    from ledger.errors import StateConflict

    move = run_moves(run, actions).get(actor, name, action_id)
    if not move.allowed:
        raise StateConflict(move.refusal)
    return move
