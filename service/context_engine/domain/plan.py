"""Plans: the pinned inputs of Region A, their rendering, measurement and rotation decisions.

A plan is rendered once per epoch; ``prefix_sha256`` covers every rendered byte plus the full
pinned tool specifications, and ``prefix_tokens`` is measured by rendering and counting.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from context_engine.domain.canonical import canonical_json, canonical_sha256
from context_engine.domain.envelope import FOLD
from context_engine.domain.errors import (
    FieldViolation,
    InvalidInput,
    PinnedModelConflict,
    PinnedVersionConflict,
    PrefixClassOverCap,
)
from context_engine.domain.estimator import (
    REQUEST_OVERHEAD_TOKENS,
    TOOL_OVERHEAD_TOKENS,
    TokenEstimator,
)
from context_engine.domain.items import (
    INDEX_HEADER,
    ONE_LINE_RULE,
    AgentInstructions,
    ContextItem,
    DeferredToolIndex,
    Framing,
    MemorySnapshotRow,
    PersonaRow,
    PlatformPolicy,
    RenderContext,
    SkillCatalogRow,
    ToolDefinitions,
    assemble,
    declaration,
    index_line,
    splits_line,
)
from context_engine.domain.model import (
    AgentSpec,
    MemorySnapshot,
    ModelProfile,
    Persona,
    PlanInputs,
    PlatformAssets,
    SessionKind,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.provider_formats import sent_tool_names
from context_engine.domain.request import (
    LEADING_USER_TEXT,
    Message,
    PrefixBlock,
    Role,
    ToolDefinition,
)
from context_engine.domain.tools import (
    INDEX_ITEM_CAP,
    INDEX_TOKEN_CAP,
    SKILL_LOAD,
    TOOL_CALL,
    TOOL_ITEM_CAP,
    TOOL_TOKEN_CAP,
    authority_scope_hashes,
    select_tools,
)
from context_engine.domain.trust import Region, TrustLevel

# @2: tool.call is defined only while the final deferred index is non-empty (an existing
# session rotates once with builder_changed at its next Plan). @3: a tool's name, a call's
# arguments and a reasoning payload are counted in their costliest sent form. @4: envelope
# escaping folds look-alikes before lower-casing too, and the platform policy's count holds the
# leading user turn some bodies open with. Neither is read from the label, which a replica of
# an older release keeps when it rotates a newer plan: a prefix whose hash its bytes miss is
# re-rendered with the older fold (builder.load_plan), and a plan whose document does not say
# it counts the turn has it counted beside its count (``uncounted_framing``). @5: the fold
# decomposes each character and drops its marks ("ü" reads as "u"), and takes Unicode's
# confusables of "<", "/" and the tag letters (``envelope.FOLD_5``). A @4 plan is current
# where it renders the same bytes, as nearly all do (``SAME_BYTES``): re-planning it could move
# its selection under a run parked on an approval. One holding a look-alike only @5 escapes
# misses its hash, is served with @4's fold and rotated by the next Plan (builder_changed).
# @6: the fold reads Unicode's tag characters both dropped and decoded (``envelope.FOLD_6``):
# a @5 plan is current where it renders the same bytes, as all but one holding a marker
# spelled in tag characters do; that one is served with @5's fold and rotated alike.
# @7: the fold reads Unicode's confusables of strings too (a run of "<" or of slashes, tag
# letters such as "rn"), and escapes an envelope's attributes as its content
# (``envelope.FOLD_7``): a @6 plan is current where it renders the same bytes, as all but one
# holding such a look-alike do; that one is served with @6's fold and rotated alike.
# @8: the fold reads letters named after a tag letter with a stroke, bar or hook, Unicode's
# right-to-left confusables, and combining letters both dropped and as their letters
# (``envelope.FOLD_8``): a @7 plan is current where it renders the same bytes, as all but one
# holding such a look-alike do; that one is served with @7's fold and rotated alike.
# @9: a deferred index entry's first sentence ends where a sentence ends, not after "e.g." or
# "Dr." or inside parentheses (``items.first_sentence``, under
# ``envelope.FOLD_9``), and provider bodies keep a tool schema's titles but the generated ones
# (``provider_common.provider_schema``). A @8 plan is current where it renders the same
# prefix, as all but one holding such an entry do; that one is served with @8's entries and
# rotated alike. Provider bodies are outside the hash: a plan pinned before @9 says so
# (``PlanSpec.keeps_schema_titles`` False) and its bodies drop every title, as it was served,
# for its whole epoch; whatever rotates it next (Plan, Rotate) pins one that keeps them.
# @10: the fold reads symbols named after a tag letter that no decomposition reads as it
# (Unicode's enclosed letters, parenthesized, negative circled and squared, and regional
# indicators) and symbols and punctuation named after "<" or "/" (``envelope.FOLD_10``):
# a @9 plan is current where it renders the same bytes, as all but one holding such a
# look-alike do; that one is served with @9's fold and rotated alike.
BUILDER_VERSION = "context-engine-builder@10"
SAME_BYTES = frozenset({"context-engine-builder@4", "context-engine-builder@5",
                        "context-engine-builder@6", "context-engine-builder@7",
                        "context-engine-builder@8", "context-engine-builder@9"})
PREFIX_CEILING = 22_000
TTL_DEFAULT = "5m"
TTL_SCHEDULED = "1h"


class PrefixClass(enum.Enum):
    """Region A classes and their caps (tokens, items or None)."""

    PLATFORM_POLICY = ("platform_policy", 2_000, None)
    AGENT_INSTRUCTIONS = ("agent_instructions", 4_000, None)
    PERSONA = ("persona", 2_000, 30)
    TOOL_DEFINITIONS = ("tool_definitions", TOOL_TOKEN_CAP, TOOL_ITEM_CAP)
    DEFERRED_TOOL_INDEX = ("deferred_tool_index", INDEX_TOKEN_CAP, INDEX_ITEM_CAP)
    SKILL_CATALOG = ("skill_catalog", 1_500, 20)
    MEMORY_SNAPSHOT = ("memory_snapshot", 1_500, 40)

    @property
    def class_name(self) -> str:
        return str(self.value[0])

    @property
    def token_cap(self) -> int:
        return int(self.value[1])

    @property
    def item_cap(self) -> int | None:
        cap = self.value[2]
        return None if cap is None else int(cap)


assert sum(c.token_cap for c in PrefixClass) == PREFIX_CEILING


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassUsage:
    """One prefix class of an epoch as measured when it was pinned."""

    class_name: str
    tokens: int
    cap: int
    items: int
    item_cap: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSpec:
    """Everything pinned on an epoch: the prefix is re-rendered from this alone."""

    builder_version: str
    assets: PlatformAssets
    agent: AgentSpec
    persona: Persona
    tools: tuple[ToolSpec, ...]  # defined, sorted by name
    deferred: tuple[ToolSpec, ...]  # index order
    skipped_tool_names: tuple[str, ...]
    filtered_tool_names: tuple[str, ...]
    skill_catalog: tuple[SkillCatalogEntry, ...]
    memory_snapshot: MemorySnapshot
    model: ModelProfile
    session_kind: SessionKind
    website_profile_id: str
    authority_scope_hashes: tuple[str, ...] | None  # None: a legacy plan from before them
    cache_ttl: str
    tokenizer: str  # label of what measured the prefix
    encoding: str  # the encoding actually loaded: Build counts with exactly this
    estimator_factor: float  # the model's base factor times any fallback factor
    # Whether the stored count holds the leading user turn (``uncounted_framing``): False for
    # a plan from before it was counted, and for one a replica of such a release rotated (its
    # documents leave out what it does not know).
    counts_leading_turn: bool = True
    # Whether provider bodies send the tool schemas' titles but the generated ones (builder@9,
    # ``provider_common.provider_schema``): False for a plan from before, whose bodies drop
    # every title as they were served when it was pinned (they are outside ``prefix_sha256``),
    # and for one a replica of such a release rotated. Kept by a plan re-appended as it is
    # (prefix_hash_canonicalized); every plan drafted anew keeps them.
    keeps_schema_titles: bool = True
    # The ceilings of what was accepted (the working state's 1,000 tokens, the loaded skills'
    # 6,000) are measured with the encoding and factor of the session's first epoch, which
    # every rotation keeps (``keeping_state_measure``): a state or skill the service accepted
    # before a rotation to another model is the same after it. None: this plan's own (an
    # epoch 1, a rotation that kept the model, a plan from before it).
    state_measure: tuple[str, float] | None = None

    @property
    def ceiling_measure(self) -> tuple[str, float]:
        """The (encoding, factor) the working state's ceiling is measured with."""
        return self.state_measure or (self.encoding, self.estimator_factor)

    def canonical(self) -> dict[str, Any]:
        return {
            "builder_version": self.builder_version,
            "assets": {"version": self.assets.version, "policy": self.assets.policy,
                       "framing": self.assets.framing},
            "agent": self.agent.canonical(),
            "persona": self.persona.canonical(),
            "tools": [t.canonical() for t in self.tools],
            "deferred": [t.canonical() for t in self.deferred],
            "skipped_tool_names": list(self.skipped_tool_names),
            "filtered_tool_names": list(self.filtered_tool_names),
            "skill_catalog": [[e.name, e.description, e.trust.value] for e in self.skill_catalog],
            "memory_snapshot": self.memory_snapshot.canonical(),
            "model": self.model.canonical(),
            "session_kind": self.session_kind.value,
            "website_profile_id": self.website_profile_id,
            "authority_scope_hashes": (None if self.authority_scope_hashes is None
                                       else list(self.authority_scope_hashes)),
            "cache_ttl": self.cache_ttl,
            "tokenizer": self.tokenizer,
            "encoding": self.encoding,
            "estimator_factor": self.estimator_factor,
            "counts_leading_turn": self.counts_leading_turn,
            "keeps_schema_titles": self.keeps_schema_titles,
            # only where it differs from the plan's own: other plans' documents are unchanged
            **({} if self.state_measure is None
               else {"state_measure": list(self.state_measure)}),
        }

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> PlanSpec:
        """Rebuild from a parsed document. Key order of the source (e.g. jsonb) is irrelevant:
        everything hashed is re-serialized canonically."""
        return cls(
            builder_version=d["builder_version"],
            assets=PlatformAssets(**d["assets"]),
            agent=AgentSpec.from_canonical(d["agent"]),
            persona=Persona.from_canonical(d["persona"]),
            tools=tuple(ToolSpec.from_canonical(t) for t in d["tools"]),
            deferred=tuple(ToolSpec.from_canonical(t) for t in d["deferred"]),
            skipped_tool_names=tuple(d["skipped_tool_names"]),
            filtered_tool_names=tuple(d["filtered_tool_names"]),
            skill_catalog=tuple(SkillCatalogEntry(name=n, description=s, trust=TrustLevel(t))
                                for n, s, t in d["skill_catalog"]),
            memory_snapshot=MemorySnapshot.from_canonical(d["memory_snapshot"]),
            model=ModelProfile.from_canonical(d["model"]),
            session_kind=SessionKind(d["session_kind"]),
            website_profile_id=d["website_profile_id"],
            authority_scope_hashes=(None if d.get("authority_scope_hashes") is None
                                    else tuple(d["authority_scope_hashes"])),
            cache_ttl=d["cache_ttl"],
            keeps_schema_titles=d.get("keeps_schema_titles", False),
            tokenizer=d["tokenizer"],
            encoding=d["encoding"],
            estimator_factor=d["estimator_factor"],
            counts_leading_turn=d.get("counts_leading_turn", False),
            state_measure=(None if d.get("state_measure") is None
                           else (d["state_measure"][0], d["state_measure"][1])),
        )

    def canonical_json(self) -> str:
        return canonical_json(self.canonical())

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def deferred_tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.deferred)


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderedPrefix:
    blocks: tuple[PrefixBlock, ...]
    tools: tuple[ToolDefinition, ...]
    prefix_sha256: str
    tool_schema_sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextPlan:
    """One epoch of a session: the pinned spec and what was measured from it."""

    tenant_id: str
    session_id: str
    epoch: int
    reason: str
    spec: PlanSpec
    prefix_sha256: str
    prefix_tokens: int
    classes: tuple[ClassUsage, ...]
    created_at: datetime | None = None
    # the stored document as parsed, when loaded from storage (legacy hash recognition)
    recorded: dict[str, Any] | None = None
    # which incarnation of the session this epoch belongs to (the store numbers each creation
    # of a session; a session erased and planned again is a new one); 0 when not stored
    incarnation: int = 0
    # whether the epoch has been counted in the metrics (context_engine_epochs_total): False
    # from its write until one call claims its count (``PlanStore.claim_count``)
    counted: bool = field(default=True, compare=False)


def prefix_items(spec: PlanSpec) -> list[ContextItem]:
    return [
        PlatformPolicy(text=spec.assets.policy),
        Framing(text=spec.assets.framing),
        AgentInstructions(text=spec.agent.instructions),
        PersonaRow(persona=spec.persona),
        ToolDefinitions(tools=spec.tools),
        DeferredToolIndex(tools=spec.deferred),
        SkillCatalogRow(entries=spec.skill_catalog),
        MemorySnapshotRow(snapshot=spec.memory_snapshot),
    ]


def _block_trust(item: ContextItem) -> TrustLevel:
    _, _, declared = declaration(type(item))
    if declared is not None:
        return declared
    if isinstance(item, (DeferredToolIndex, SkillCatalogRow)):
        return item.block_trust()
    raise AssertionError(f"{type(item).__name__} has per-entry trust but no block trust")


def render_prefix(spec: PlanSpec, session_key: str, *,
                  recorded: dict[str, Any] | None = None,
                  fold: int = FOLD) -> RenderedPrefix:
    """Render Region A. Pure; the same spec and session key always give the same bytes.

    ``recorded`` is a stored plan document: its tool specifications then enter the hash as
    they were recorded (a legacy plan may hold scope sets in its writer's iteration order),
    which is how a legacy hash is recognised. The rendered bytes are the same either way.
    ``fold``: envelopes escaped with an older builder's fold (``envelope.FOLDS``), to re-render
    a plan one of them pinned or rotated."""
    ctx = RenderContext(session_key=session_key, fold=fold)
    blocks: list[PrefixBlock] = []
    tools: tuple[ToolDefinition, ...] = ()
    for item in assemble(prefix_items(spec), Region.A):
        if isinstance(item, ToolDefinitions):
            tools = item.definitions()
            continue
        text = item.render(ctx)  # type: ignore[attr-defined]
        if text:  # empty persona, index, catalog and snapshot render no bytes
            blocks.append(PrefixBlock(row=declaration(type(item))[0],
                                      trust=_block_trust(item), text=text))
    tool_specs = [t.canonical() for t in spec.tools] if recorded is None else recorded["tools"]
    deferred_specs = ([t.canonical() for t in spec.deferred] if recorded is None
                      else recorded["deferred"])
    digest = canonical_sha256({
        # The same bytes sent to another model are another cache entry and another prefix:
        # provider tokenization and tool serialization differ.
        "model": [spec.model.provider, spec.model.model_id],
        "blocks": [[b.row, b.trust.value, b.text] for b in blocks],
        "tools": [[d.name, d.description, d.input_schema_json] for d in tools],
        "tool_specs": tool_specs,
        "deferred_specs": deferred_specs,
    })
    return RenderedPrefix(blocks=tuple(blocks), tools=tools, prefix_sha256=digest,
                          tool_schema_sha256=canonical_sha256(tool_specs))


def tool_cost(tool: ToolSpec, estimator: TokenEstimator) -> int:
    """Conservative model-visible cost: name, description and full schema plus framing; the
    name in its costliest sent form (``a.b`` goes out as ``a__b``: provider_formats.py)."""
    return max(estimator.text(canonical_json({"name": name, "description": tool.description,
                                              "input_schema": tool.input_schema}))
               for name in sent_tool_names(tool.name)) + TOOL_OVERHEAD_TOKENS


# The user turn Anthropic's, Gemini's and Bedrock's bodies open with when the history a Build
# keeps begins with the model's own turn (provider_common ``Turns.lead``): request framing
# any Build may send, counted with the platform policy like the rest of it.
_LEADING_TURN = Message(row=9, role=Role.USER, trust=TrustLevel.PLATFORM, text=LEADING_USER_TEXT)


def uncounted_framing(spec: PlanSpec, estimator: TokenEstimator) -> int:
    """Request framing a pinned plan's stored count leaves out and every Build of it must
    count: the leading user turn, for a plan measured before it was counted
    (``PlanSpec.counts_leading_turn``; a Build may send the turn whatever measured the plan)."""
    return 0 if spec.counts_leading_turn else estimator.message(_LEADING_TURN)


def request_framing(rendered: RenderedPrefix) -> int:
    """Tokens the request's own framing costs, counted with the platform policy that opens
    it: the system message and the reply primer, and one separator per join where a provider
    body sends the prefix blocks as one text (OpenAI ``instructions`` joins them with a blank
    line). The leading user turn some bodies add is counted beside it (``measure_prefix``)."""
    return REQUEST_OVERHEAD_TOKENS + max(len(rendered.blocks) - 1, 0)


def measure_prefix(spec: PlanSpec, rendered: RenderedPrefix, estimator: TokenEstimator, *,
                   held: frozenset[PrefixClass] = frozenset()) -> tuple[ClassUsage, ...]:
    """Count every class by rendering and counting; fail on any cap, never truncate.

    ``held``: classes whose content is a pinned plan's, or a part of it, counted with the
    same tokenizer (a rotation that keeps the model): the pinned plan held them within their
    caps, so they are counted and stored as they measure now and never fail a cap. A newer
    builder may count the same content a few tokens higher (``BUILDER_VERSION``), and a
    rotation that only removes (a security revocation) must never fail on that."""
    by_row: dict[int, int] = {}
    for block in rendered.blocks:
        by_row[block.row] = by_row.get(block.row, 0) + estimator.text(block.text)
    measured = {
        PrefixClass.PLATFORM_POLICY: (by_row.get(1, 0) + by_row.get(2, 0)
                                      + request_framing(rendered)
                                      + estimator.message(_LEADING_TURN), 2),
        PrefixClass.AGENT_INSTRUCTIONS: (by_row.get(3, 0), 1),
        PrefixClass.PERSONA: (by_row.get(4, 0), len(spec.persona.entries)),
        PrefixClass.TOOL_DEFINITIONS: (sum(tool_cost(t, estimator) for t in spec.tools),
                                       len(spec.tools)),
        PrefixClass.DEFERRED_TOOL_INDEX: (by_row.get(6, 0), len(spec.deferred)),
        PrefixClass.SKILL_CATALOG: (by_row.get(7, 0), len(spec.skill_catalog)),
        PrefixClass.MEMORY_SNAPSHOT: (by_row.get(8, 0), len(spec.memory_snapshot.items)),
    }
    usage: list[ClassUsage] = []
    over = 0  # tokens of held classes past their caps: the ceiling grants them too
    for cls, (tokens, items) in measured.items():
        if cls in held:
            over += max(tokens - cls.token_cap, 0)
        else:
            if cls.item_cap is not None and items > cls.item_cap:
                raise PrefixClassOverCap(cls.class_name, items, cls.item_cap, unit="items",
                                         measured_tokens=tokens, token_cap=cls.token_cap)
            if tokens > cls.token_cap:
                raise PrefixClassOverCap(cls.class_name, tokens, cls.token_cap)
        usage.append(ClassUsage(class_name=cls.class_name, tokens=tokens, cap=cls.token_cap,
                                items=items, item_cap=cls.item_cap or 0))
    total = sum(u.tokens for u in usage)
    # unreachable while the caps sum to the ceiling; kept as a guard
    if total > PREFIX_CEILING + over:
        raise PrefixClassOverCap("prefix", total, PREFIX_CEILING)
    return tuple(usage)


def cache_ttl_for(kind: SessionKind) -> str:
    """The prefix's cache TTL: an hour for scheduled sessions, the default otherwise."""
    return TTL_SCHEDULED if kind is SessionKind.SCHEDULED else TTL_DEFAULT


def make_spec(inputs: PlanInputs, estimator: TokenEstimator, session_key: str) -> PlanSpec:
    """Resolve and pin a plan's inputs: tool selection, TTL, scope hashes."""
    ctx = RenderContext(session_key=session_key)
    selection = select_tools(
        inputs,
        tool_cost=lambda t: tool_cost(t, estimator),
        # an entry as it renders (its envelope carries this session's nonce), plus its newline
        index_cost=lambda t: estimator.text(index_line(t, ctx)) + 1,
        index_overhead=estimator.text(INDEX_HEADER),
        # the class is measured on the rendered block: selection trims the index to fit it
        index_measure=lambda ts: estimator.text(DeferredToolIndex(tools=ts).render(ctx)),
    )
    return PlanSpec(
        builder_version=BUILDER_VERSION,
        assets=inputs.assets,
        agent=inputs.agent,
        persona=inputs.persona,
        tools=selection.defined,
        deferred=selection.deferred,
        skipped_tool_names=selection.skipped_tool_names,
        filtered_tool_names=selection.filtered_tool_names,
        # the catalog is advertised only where skill.load is defined (never in email sessions)
        skill_catalog=(inputs.skill_catalog
                       if any(t.name == SKILL_LOAD for t in selection.defined) else ()),
        memory_snapshot=inputs.memory_snapshot,
        model=inputs.model,
        session_kind=inputs.session_kind,
        website_profile_id=inputs.website_profile_id,
        authority_scope_hashes=authority_scope_hashes(inputs.principal_scopes),
        cache_ttl=cache_ttl_for(inputs.session_kind),
        tokenizer=estimator.tokenizer,
        encoding=estimator.encoding,
        estimator_factor=estimator.base_factor,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDraft:
    """A plan ready to be pinned as the next epoch."""

    spec: PlanSpec
    rendered: RenderedPrefix
    classes: tuple[ClassUsage, ...]

    @property
    def prefix_tokens(self) -> int:
        return sum(c.tokens for c in self.classes)


def attribute_violations(inputs: PlanInputs) -> list[FieldViolation]:
    """Values the prefix renders as an envelope's attributes (a tool's server in the index,
    row 6; the snapshot's id, row 8) that would break or reorder its line (``splits_line``).
    The API refuses them with the rest of a request's violations; checked here too, so the
    pure path renders no such prefix either."""
    found = [FieldViolation(f"tool_catalog[{i}].server", ONE_LINE_RULE)
             for i, tool in enumerate(inputs.tool_catalog) if splits_line(tool.server)]
    return found + _snapshot_violations(inputs.memory_snapshot, "memory_snapshot")


def _snapshot_violations(snapshot: MemorySnapshot, field: str) -> list[FieldViolation]:
    return ([FieldViolation(f"{field}.snapshot_id", ONE_LINE_RULE)]
            if splits_line(snapshot.snapshot_id) else [])


def draft_plan(inputs: PlanInputs, session_key: str, estimator: TokenEstimator) -> PlanDraft:
    violations = attribute_violations(inputs)
    if violations:
        raise InvalidInput(violations)
    spec = make_spec(inputs, estimator, session_key)
    rendered = render_prefix(spec, session_key)
    return PlanDraft(spec=spec, rendered=rendered,
                     classes=measure_prefix(spec, rendered, estimator))


def draft_pinned(inputs: PlanInputs, pinned: PlanSpec, session_key: str,
                 estimator: TokenEstimator) -> PlanDraft:
    """A rebuild under a pinned run (tool pins or pending calls): the request's identities
    (agent, persona, model, policy, snapshot) with the pinned plan's advertisement and authority
    (defined and deferred tools, skill catalog, scope hashes, website profile), never resolved
    again from the request's catalog and scopes (spec: "retries and approval resumes must not
    refresh authority or rewrite their advertised tools"). With the model kept, the classes
    kept whole are held (``measure_prefix``), as an explicit rotation holds them: a plan an
    older builder counted lower never fails a cap here. Everything else is measured afresh:
    caps fail, never truncate."""
    violations = _snapshot_violations(inputs.memory_snapshot, "memory_snapshot")
    if violations:  # the pinned tools were checked when they were pinned
        raise InvalidInput(violations)
    spec = replace(
        pinned, builder_version=BUILDER_VERSION, counts_leading_turn=True,
        keeps_schema_titles=True,
        assets=inputs.assets, agent=inputs.agent,
        persona=inputs.persona, memory_snapshot=inputs.memory_snapshot, model=inputs.model,
        session_kind=inputs.session_kind,
        cache_ttl=cache_ttl_for(inputs.session_kind),
        tokenizer=estimator.tokenizer, encoding=estimator.encoding,
        estimator_factor=estimator.base_factor)
    rendered = render_prefix(spec, session_key)
    held = (frozenset({PrefixClass.TOOL_DEFINITIONS, PrefixClass.DEFERRED_TOOL_INDEX,
                       PrefixClass.SKILL_CATALOG})
            if inputs.model == pinned.model else frozenset())
    return PlanDraft(spec=spec, rendered=rendered,
                     classes=measure_prefix(spec, rendered, estimator, held=held))


SESSION_OPENED = "session_opened"


def rotation_reason(current: PlanSpec, new: PlanSpec) -> str | None:
    """Why ``new`` must replace the pinned ``current`` as a new epoch, or None to keep it."""
    return rotation_reason_for(current, agent=new.agent, persona=new.persona,
                               model_id=new.model.model_id, assets=new.assets,
                               builder_version=new.builder_version)


def _version_order(version: str) -> tuple[str, tuple[tuple[int, int | str], ...], str]:
    """A version's name (the text up to its last ``@``; without one, the whole text, and no
    revision) and its revision (the rest), split into runs of digits, compared as numbers,
    and of other text, compared as text; then the text itself, so that two revisions that
    compare alike (``@1.0`` and ``@1.00``) are still ordered."""
    name, at, revision = version.rpartition("@")
    if not at:
        return version, (), version
    runs = re.findall(r"[0-9]+|[^0-9]+", revision)
    return name, tuple((0, int(r)) if r[0] in "0123456789" else (1, r) for r in runs), version


def is_older(version: str, than: str) -> bool:
    """Whether ``version`` is an older revision of the same name as ``than``
    (``platform-policy@2026-11-30.9`` is older than ``platform-policy@2026-12-01.2``, ``@2``
    than ``@10``, ``@1.0`` than ``@1.0-hotfix``). Versions of different names, or without a
    revision (no ``@``), are not ordered: neither is older."""
    mine, theirs = _version_order(version), _version_order(than)
    return mine[0] == theirs[0] and bool(mine[1]) and mine[1:] < theirs[1:]


def rotation_reason_for(current: PlanSpec, *, agent: AgentSpec, persona: Persona,
                        model_id: str, assets: PlatformAssets,
                        builder_version: str) -> str | None:
    """The rotation a Plan call with these pinned identities requires, or None.

    The tool set, scopes and snapshot are pinned at session open: a change to them alone
    never rotates (revocation is enforced at call time), so they are not even looked at.
    Pinned versions pin content: the same version with other content is a conflict.
    Platform policy and builder rotate forward only: a replica whose own version is older
    than the pinned one (a rolling deploy: the newer replicas pinned it) keeps the pinned plan,
    so replicas of two releases never rotate a session back and forth.
    The conflicts are found before any reason: another model (or agent version) does not let
    the same version (or revision) hold other content.
    """
    same_agent = (current.agent.version == agent.version
                  and current.agent.agent_id == agent.agent_id)
    if same_agent and current.agent != agent:
        raise PinnedVersionConflict("agent", agent.version)
    if current.persona.revision == persona.revision and current.persona != persona:
        raise PinnedVersionConflict("persona", persona.revision)
    if current.assets.version == assets.version and current.assets != assets:
        raise PinnedVersionConflict("policy", assets.version)
    if current.model.model_id != model_id:
        return "model_changed"
    if not same_agent:
        return "agent_version_changed"
    if current.persona.revision != persona.revision:
        return "persona_changed"
    if (current.assets.version != assets.version
            and not is_older(assets.version, current.assets.version)):
        return "policy_changed"
    if (current.builder_version != builder_version
            and current.builder_version not in SAME_BYTES
            and not is_older(builder_version, current.builder_version)):
        return "builder_changed"
    return None


def keeping_state_measure(draft: PlanDraft, base: PlanSpec) -> PlanDraft:
    """A new epoch over ``base`` measures the working state's ceiling as ``base`` did (the
    session's first epoch's measure, carried on): a rotation to a model whose tokenizer counts
    more must not fail, nor trim, a state the service accepted (a state of 996 tokens accepted
    on gpt-4o is 1,294 by Claude's estimate)."""
    measure = base.ceiling_measure
    own = (draft.spec.encoding, draft.spec.estimator_factor)
    return replace(draft, spec=replace(draft.spec,
                                       state_measure=None if measure == own else measure))


def capability_conflict(pinned: ModelProfile, model_id: str, *, context_window: int | None,
                        output_reserve: int | None, breakpoint_budget: int | None) -> None:
    """Refuses a Plan that would keep the pinned plan (nothing rotates it) while declaring a
    capability of the same model other than the one pinned: the pinned value would be used
    silently (a window the caller says is smaller would let a Build overrun it). Capabilities
    the Plan leaves out are the pinned ones; another model id is a ``model_changed`` rotation,
    which takes the request's capabilities. A pinned model's sizing changes by a
    ``model_routed`` Rotate."""
    if pinned.model_id != model_id:
        return
    for name, declared in (("context_window", context_window),
                           ("output_reserve", output_reserve),
                           ("breakpoint_budget", breakpoint_budget)):
        held = getattr(pinned, name)
        if declared is not None and declared != held:
            raise PinnedModelConflict(model_id, f"model.capabilities.{name}", held, declared)


ROTATION_REASONS = ("security_revocation", "model_routed", "snapshot_invalidated", "operator")


def redraft(spec: PlanSpec, session_key: str, estimator: TokenEstimator, *,
            drop_tools: tuple[str, ...] = (), model: ModelProfile | None = None,
            snapshot: MemorySnapshot | None = None) -> PlanDraft:
    """An explicit rotation's plan: the pinned spec with tools removed, another model or
    another snapshot, re-rendered and re-measured (caps still fail, never truncate). With the
    model kept, every class but a replaced snapshot holds the pinned plan's content or a part
    of it, counted with the same tokenizer: those are held (``measure_prefix``), so a
    revocation never fails on a cap, even on a plan an older builder counted lower."""
    if snapshot is not None and (violations := _snapshot_violations(snapshot, "memory_snapshot")):
        raise InvalidInput(violations)
    pinned_names = set(spec.tool_names) | set(spec.deferred_tool_names)
    unknown = [n for n in drop_tools if n not in pinned_names]
    if unknown:
        raise InvalidInput([FieldViolation(f"drop_tools[{drop_tools.index(n)}]",
                                           f"{n!r} is not advertised by the current plan")
                            for n in unknown])
    drop = set(drop_tools)
    # the index advertises tools to call through tool.call: without it, none (ADR-0123: the
    # index and tool.call come and go together)
    deferred = (() if TOOL_CALL in drop
                else tuple(t for t in spec.deferred if t.name not in drop))
    tools = tuple(t for t in spec.tools if t.name not in drop
                  and not (t.name == TOOL_CALL and not deferred))  # nothing left to call
    # the catalog is advertised only where skill.load is defined (as a first draft does)
    catalog = spec.skill_catalog if any(t.name == SKILL_LOAD for t in tools) else ()
    # Measured by this builder, so its count holds the leading turn; the builder version stays
    # the pinned plan's: what it holds was selected under that builder's rules, which the next
    # Plan applies anew (builder_changed) when they are older.
    new = replace(spec, counts_leading_turn=True,
                  tools=tools, deferred=deferred, skill_catalog=catalog,
                  model=model or spec.model,
                  memory_snapshot=spec.memory_snapshot if snapshot is None else snapshot,
                  keeps_schema_titles=True,  # a new epoch's bodies keep the schemas' titles
                  tokenizer=estimator.tokenizer, encoding=estimator.encoding,
                  estimator_factor=estimator.base_factor)
    rendered = render_prefix(new, session_key)
    held: frozenset[PrefixClass] = frozenset()
    if model is None:
        held = frozenset(PrefixClass) - (
            frozenset() if snapshot is None else {PrefixClass.MEMORY_SNAPSHOT})
    return PlanDraft(spec=new, rendered=rendered,
                     classes=measure_prefix(new, rendered, estimator, held=held))


def admission_reason(current: PlanSpec, *, unpinned: bool, principal_scopes: tuple[str, ...],
                     website_profile_id: str,
                     invalidated_trace_ids: tuple[str, ...] = ()) -> str | None:
    """Rotations that depend on the run being admitted (spec: "Prefix epochs").

    - A snapshot whose recall trace was invalidated rotates at the next Plan.
    - Only at an unpinned admission (the run has no tool pins and no pending calls yet):
      newly granted scopes rebuild the plan (run_authority_changed) — scope reduction alone
      never rotates — and a changed website profile rotates (browser_profile_changed).
    """
    trace = current.memory_snapshot.recall_trace_id
    if trace and trace in invalidated_trace_ids:
        return "snapshot_invalidated"
    if not unpinned:
        return None
    if current.authority_scope_hashes is None:  # a legacy plan rebuilds once
        return "run_authority_changed"
    if set(authority_scope_hashes(principal_scopes)) - set(current.authority_scope_hashes):
        return "run_authority_changed"
    if website_profile_id != current.website_profile_id:
        return "browser_profile_changed"
    return None
