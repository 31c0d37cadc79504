"""Domain errors. The servicer maps each class to a gRPC status in one table."""

from __future__ import annotations

from dataclasses import dataclass


class ContextEngineError(Exception):
    """Root of every error the domain raises on purpose."""

    reason: str = "CONTEXT_ENGINE_ERROR"
    # When the failed call was the model's own tool call: the tool result the runtime returns
    # to the model (the status carries it as a google.rpc.LocalizedMessage). Never content.
    tool_result: str = ""

    def metadata(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidInput(ContextEngineError):
    """Malformed input; carries one violation per offending field."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: list[FieldViolation]) -> None:
        self.violations = tuple(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))

    @classmethod
    def one(cls, field: str, description: str) -> InvalidInput:
        return cls([FieldViolation(field, description)])

    def metadata(self) -> dict[str, str]:
        return {"fields": ",".join(v.field for v in self.violations)}


class PrefixClassOverCap(ContextEngineError):
    """A Region A class exceeds its cap: the session fails to open, nothing is truncated."""

    reason = "PREFIX_CLASS_OVER_CAP"

    def __init__(self, class_name: str, tokens: int, cap: int, *, unit: str = "tokens",
                 measured_tokens: int | None = None, token_cap: int | None = None) -> None:
        """``tokens`` and ``cap`` are in ``unit``; an item-cap failure also carries the class's
        measured tokens and token cap."""
        self.class_name = class_name
        self.tokens = tokens
        self.cap = cap
        self.unit = unit
        self.measured_tokens = measured_tokens
        self.token_cap = token_cap
        super().__init__(f"prefix class {class_name} is {tokens} {unit}, over its cap of {cap}")

    def metadata(self) -> dict[str, str]:
        meta = {
            "class": self.class_name,
            "tokens" if self.unit == "tokens" else self.unit: str(self.tokens),
            "cap": str(self.cap),
            "unit": self.unit,
        }
        if self.unit != "tokens" and self.measured_tokens is not None:
            meta["tokens"] = str(self.measured_tokens)
        if self.unit != "tokens" and self.token_cap is not None:
            meta["token_cap"] = str(self.token_cap)
        return meta


class RequiredToolUnavailable(ContextEngineError):
    """A tool the session requires (browser tools of a website-bound session) cannot be defined."""

    reason = "REQUIRED_TOOL_UNAVAILABLE"

    def __init__(self, tool_name: str, why: str) -> None:
        self.tool_name = tool_name
        self.why = why
        super().__init__(f"required tool {tool_name} cannot be defined: {why}")

    def metadata(self) -> dict[str, str]:
        return {"tool": self.tool_name, "why": self.why}


class PinnedVersionConflict(ContextEngineError):
    """A pinned version (agent version, persona revision, policy version) arrived with
    different content: versions pin content, so the change needs a new version."""

    reason = "PINNED_VERSION_CONFLICT"

    def __init__(self, what: str, version: str) -> None:
        self.what = what
        self.version = version
        super().__init__(
            f"{what} version {version!r} is pinned with different content; "
            "publish the change under a new version")

    def metadata(self) -> dict[str, str]:
        return {"what": self.what, "version": self.version}


class PinnedModelConflict(PinnedVersionConflict):
    """A Plan declared a capability of the pinned model (by its id) other than the plan pinned,
    and nothing else rotates the session: the pinned value would be used silently. A model's
    sizing changes only by an explicit ``model_routed`` Rotate, as its id does."""

    def __init__(self, model_id: str, field: str, pinned: int, requested: int) -> None:
        self.what, self.version = "model", model_id
        self.field, self.pinned, self.requested = field, pinned, requested
        ContextEngineError.__init__(
            self, f"model {model_id!r} is pinned with {field} {pinned}, not {requested}; "
            "send the pinned value (or none), or Rotate model_routed to the new one")

    def metadata(self) -> dict[str, str]:
        return {"what": "model", "version": self.version, "field": self.field,
                "pinned": str(self.pinned), "requested": str(self.requested)}


class BudgetExceeded(ContextEngineError):
    """Items that never yield do not fit; the request is never returned without them.
    ``pressure`` carries what the yield ladder did before giving up, if it ran;
    ``max_summary_tokens``, where a compaction that merges the current summary can make the
    body fit, the largest summary cap that does (``budget.summary_cap``)."""

    reason = "BUDGET_EXCEEDED"

    def __init__(self, class_name: str, tokens: int, limit: int, *, unit: str = "tokens",
                 pressure: object | None = None, max_summary_tokens: int | None = None) -> None:
        self.class_name = class_name
        self.tokens = tokens
        self.limit = limit
        self.unit = unit
        self.pressure = pressure
        self.max_summary_tokens = max_summary_tokens
        super().__init__(f"{class_name} needs {tokens} {unit} but only {limit} are allowed")

    def metadata(self) -> dict[str, str]:
        meta = {"class": self.class_name, "tokens" if self.unit == "tokens" else self.unit:
                str(self.tokens), "limit": str(self.limit), "unit": self.unit}
        if self.max_summary_tokens is not None:
            meta["max_summary_tokens"] = str(self.max_summary_tokens)
        return meta


class HistoryFloorUnreachable(ContextEngineError):
    """The plan's body budget (capacity - output reserve - margin - prefix) cannot hold the
    8,000-token history floor even with every other body class empty: the session fails to
    open with the numbers rather than building requests that can never keep the floor."""

    reason = "HISTORY_FLOOR_UNREACHABLE"

    def __init__(self, *, model_id: str, window: int, policy_cap_tokens: int,
                 output_reserve: int, margin_tokens: int, prefix_tokens: int, body_budget: int,
                 history_floor: int, measured_prefix_tokens: int | None = None,
                 estimator_factor: float | None = None) -> None:
        self.model_id = model_id
        self.window = window
        self.policy_cap_tokens = policy_cap_tokens
        self.output_reserve = output_reserve
        self.margin_tokens = margin_tokens
        self.prefix_tokens = prefix_tokens  # as Build charges it
        self.body_budget = body_budget
        self.history_floor = history_floor
        # where the prefix is charged otherwise than measured (an estimate scaled by the
        # tenant's correction factor): the measured count and the factor
        self.measured_prefix_tokens = measured_prefix_tokens
        self.estimator_factor = estimator_factor
        capacity = (f"min(window {window}, policy cap {policy_cap_tokens})"
                    if policy_cap_tokens else f"window {window}")
        prefix = f"prefix {prefix_tokens}"
        if self.scaled:
            prefix += (f" ({measured_prefix_tokens} measured, at the correction factor "
                       f"{estimator_factor:g} ReportUsage reconciled for it)")
        super().__init__(
            f"model {model_id}: {capacity} - output reserve {output_reserve} - margin "
            f"{margin_tokens} - {prefix} leaves a body budget of {body_budget}, "
            f"below the history floor of {history_floor}; use a model with a larger window, a "
            "smaller output reserve or a smaller prefix")

    @property
    def scaled(self) -> bool:
        """The prefix is charged at a correction factor, otherwise than it measured."""
        return (self.measured_prefix_tokens is not None and self.estimator_factor is not None
                and self.measured_prefix_tokens != self.prefix_tokens)

    def metadata(self) -> dict[str, str]:
        meta = {"model": self.model_id, "window": str(self.window),
                "output_reserve": str(self.output_reserve), "margin": str(self.margin_tokens),
                "prefix_tokens": str(self.prefix_tokens), "body_budget": str(self.body_budget),
                "history_floor": str(self.history_floor)}
        if self.policy_cap_tokens:
            meta["policy_cap"] = str(self.policy_cap_tokens)
        if self.scaled:
            meta["prefix_measured"] = str(self.measured_prefix_tokens)
            meta["estimator_factor"] = f"{self.estimator_factor:g}"
        return meta


class SessionNotFound(ContextEngineError):
    reason = "SESSION_NOT_FOUND"

    def __init__(self, tenant_id: str, session_id: str, epoch: int | None = None) -> None:
        self.tenant_id = tenant_id
        self.session_id = session_id
        self.epoch = epoch
        what = f"epoch {epoch} of session" if epoch else "session"
        super().__init__(f"{what} {session_id} not found")

    def metadata(self) -> dict[str, str]:
        meta = {"session_id": self.session_id}
        if self.epoch:
            meta["epoch"] = str(self.epoch)
        return meta


class BuildBaseUnknown(ContextEngineError):
    """An incremental Build named a base this replica does not hold (another replica built it,
    this one restarted or evicted it, or it belongs to another session): nothing was built, and
    the caller sends the Build again with its whole checkpoint."""

    reason = "BUILD_BASE_UNKNOWN"

    def __init__(self, base_build_id: str, why: str) -> None:
        self.base_build_id = base_build_id
        self.why = why
        super().__init__(f"base build {base_build_id!r} is not held by this replica ({why}): "
                         "send the Build again with the whole checkpoint and no base")

    def metadata(self) -> dict[str, str]:
        return {"base_build_id": self.base_build_id, "why": self.why}


class PrefixHashMismatch(ContextEngineError):
    """Re-rendering a stored plan gave different bytes than it was pinned with: a defect."""

    reason = "PREFIX_HASH_MISMATCH"

    def __init__(self, stored: str, rendered: str, epoch: int) -> None:
        self.stored = stored
        self.rendered = rendered
        self.epoch = epoch
        super().__init__(
            f"epoch {epoch}: stored prefix_sha256 {stored} but re-rendered {rendered}"
        )

    def metadata(self) -> dict[str, str]:
        return {"stored_sha256": self.stored, "rendered_sha256": self.rendered,
                "epoch": str(self.epoch)}


class TokenizerUnavailable(ContextEngineError):
    """The encoding a plan pinned cannot be loaded by this replica: counting with another
    would make Build depend on where it runs."""

    reason = "TOKENIZER_UNAVAILABLE"

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        super().__init__(f"encoding {encoding} pinned by the plan is not available here")

    def metadata(self) -> dict[str, str]:
        return {"encoding": self.encoding}


class StoreUnavailable(ContextEngineError):
    """The database cannot be reached; the call changed nothing. ``cause``: the driver's error
    class, and ``sqlstate`` the database's code where it gave one (both in the metadata, so
    that a caller tells a failover from a deadlock without reading the message)."""

    reason = "STORE_UNAVAILABLE"

    def __init__(self, message: str, *, cause: str = "", sqlstate: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.sqlstate = sqlstate

    def metadata(self) -> dict[str, str]:
        meta = {"cause": self.cause} if self.cause else {}
        if self.sqlstate:
            meta["sqlstate"] = self.sqlstate
        return meta


class CountUnsettled(StoreUnavailable):
    """A claim of an epoch's count (``PlanStore.claim_count``) whose COMMIT was sent and went
    unanswered (the connection lost during it): it may have committed. The store handed it to
    what settles such claims (the process's maintenance cycles), which counts the epoch once
    that transaction has ended if the epoch's row shows the claim (it committed, on the
    database as it is now); the caller counts nothing."""


class StoreConflict(StoreUnavailable):
    """The database rolled the call's transaction back on a conflict with a concurrent one (a
    deadlock, a serialization failure): the call changed nothing, and a retry can succeed. A
    kind of StoreUnavailable, so what absorbs an outage (the outbox's buffer) absorbs it too."""

    reason = "STORE_CONFLICT"


class AssemblyError(ContextEngineError):
    """An item type without a declared region or row reached assembly: a build failure."""

    reason = "ASSEMBLY_ERROR"


class ConstraintCapReached(ContextEngineError):
    """add_constraints at the cap: constraints never evict, so the call fails (the agent can
    surface it) rather than silently dropping the oldest."""

    reason = "CONSTRAINT_CAP_REACHED"

    def __init__(self, constraints: int, adding: int, cap: int) -> None:
        self.constraints = constraints
        self.adding = adding
        self.cap = cap
        super().__init__(f"working state holds {constraints} constraints; adding {adding} "
                         f"would pass the cap of {cap} (constraints never evict)")

    def metadata(self) -> dict[str, str]:
        return {"constraints": str(self.constraints), "adding": str(self.adding),
                "cap": str(self.cap)}


class CompactionDepthExceeded(ContextEngineError):
    """A third compaction: summaries merge once (depth 2) and never again, because a summary of
    a summary of a summary can no longer be checked against what happened. The run has
    outgrown its window: escalate to a child run with its own budget, or hand off."""

    reason = "COMPACTION_DEPTH_EXCEEDED"

    def __init__(self, depth: int, cap: int = 2) -> None:
        self.depth = depth
        self.cap = cap
        super().__init__(f"the checkpoint's summary is at depth {depth}, the cap of {cap}: "
                         "escalate to a child run (or hand off) instead of compacting again")

    def metadata(self) -> dict[str, str]:
        return {"depth": str(self.depth), "cap": str(self.cap),
                "advice": "escalate_to_child_run"}


class NothingToCompact(ContextEngineError):
    """The target names no whole unit of carried history above the summary floor (the active
    run's items are never compacted)."""

    reason = "NOTHING_TO_COMPACT"

    def __init__(self, floor: int) -> None:
        self.floor = floor
        super().__init__(f"no carried history above the summary floor ({floor}) matches the "
                         "target; the active run's items are never compacted")

    def metadata(self) -> dict[str, str]:
        return {"summary_floor": str(self.floor)}


class SummarizerUnavailable(ContextEngineError):
    """The summarizer's model endpoint failed (5xx, timeout, unreachable): nothing stored."""

    reason = "SUMMARIZER_UNAVAILABLE"

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"the summarizer is unavailable: {why}; nothing was stored")

    def metadata(self) -> dict[str, str]:
        return {"why": self.why}


class SummarizerRefused(ContextEngineError):
    """The summarizer's model endpoint refused the request with a 4xx no retry changes (a
    wrong or missing key, a model or URL that does not exist, a request it will not take):
    its configuration, not an outage. Nothing stored."""

    reason = "SUMMARIZER_REFUSED"

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"the summarizer refused the request: {why}; nothing was stored "
                         "(check CE_SUMMARIZER_URL, CE_SUMMARIZER_MODEL and "
                         "CE_SUMMARIZER_API_KEY)")

    def metadata(self) -> dict[str, str]:
        return {"why": self.why}


class ResponseTooLarge(ContextEngineError):
    """A response over the service's send limit: not sent (gRPC would refuse it bare)."""

    reason = "RESPONSE_TOO_LARGE"

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"the response is {size} bytes, over the limit of {limit} bytes "
                         "(CE_MAX_SEND_BYTES): ask PROVIDER_FORMAT_NONE (a provider body "
                         "repeats the request), Build incrementally, or raise the limit here "
                         "and the client's receive limit")

    def metadata(self) -> dict[str, str]:
        return {"size": str(self.size), "limit": str(self.limit)}


class RequestTooLarge(ContextEngineError):
    """A request over the service's receive limit: refused before it is decoded."""

    reason = "REQUEST_TOO_LARGE"

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"the request is {size} bytes, over the limit of {limit} bytes "
                         "(CE_MAX_RECEIVE_BYTES)")

    def metadata(self) -> dict[str, str]:
        return {"size": str(self.size), "limit": str(self.limit)}
