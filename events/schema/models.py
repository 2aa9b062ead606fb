"""The catalog: models and the profiles their replicas run with (SPEC CAT-1 to CAT-5).

One aggregate per model (``llmgw.evt.model.<name>``). A model's ``spec`` is the whole definition;
edits write the new spec (``model.changed``) so any reader can fold a model from its last spec
event alone. Scaling, stop/start and parking are their own events because the scheduler and the
CLI read them as such.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "model"
SERVICE = "catalog"

ENGINES = ("llamacpp", "vllm")
ROUTES = ("chat", "completion", "embedding")
CLASSES = ("critical", "standard", "opportunistic")


class GpuRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    count: int = 0
    min_memory_gb: float = 0.0


class Profile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one replica runs (CAT-2)."""

    name: str = "default"
    engine: str = "llamacpp"
    args: list[str] = []
    env: dict[str, str] = {}
    gpus: GpuRequest | None = None
    min_memory_gb: float | None = None  # host memory reserved
    cpu_cores: int | None = None  # reserved; becomes --threads
    min_disk_gb: float | None = None
    node_selector: dict[str, str] = {}
    priority: int = 0
    weight: int = 1
    ctx_size: int | None = None
    parallel: int | None = None
    tool_parser: str | None = None  # vLLM: --tool-call-parser for tool calls (hermes, llama3_json, mistral…)


class Scaling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min: int = 1
    max: int | None = None  # follows min when left out

    @property
    def upper(self) -> int:
        return self.min if self.max is None else self.max


class Slo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request of the model should get (CAT-1): a measurement (SCHED-10) finds how many
    concurrent requests one replica serves within it; autoscaling then follows that (SCHED-9)."""

    ttft_p95_s: float | None = None  # time to first token, 95th percentile, seconds
    tokens_per_s: float | None = None  # generation speed each request should see


class ExternalProvider(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An OpenAI-compatible API outside the cluster that serves a model (GW-12). The keys themselves are
    never here: ``key_env`` names the router's environment variables that hold them, read per request."""

    url: str  # the API's base URL as its clients take it: https://api.example.com/v1
    key_env: list[str]  # environment variables of the router holding its API keys, used in turn
    model: str | None = None  # the model's name at the provider; None: the catalog name
    input_usd_per_m: float | None = None  # what the provider charges per million prompt tokens
    output_usd_per_m: float | None = None  # … and per million generated tokens

    @property
    def host(self) -> str:
        """The provider as errors and usage records name it: its URL's host (and port)."""
        try:  # the host and port alone: never credentials a URL might carry
            parts = urlsplit(self.url)
            host, port = parts.hostname, parts.port
        except ValueError:
            return "an unreadable URL"
        if not host:
            return "an unreadable URL"
        return f"{host}:{port}" if port else host

    @property
    def priced(self) -> bool:
        return self.input_usd_per_m is not None and self.output_usd_per_m is not None


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def provider_problem(p: ExternalProvider) -> str | None:
    """Why a provider cannot be used as written, or None. Never quotes a ``key_env`` entry: one that is not
    a variable's name may be the key itself, pasted by mistake, and this message goes on the log."""
    try:
        parts = urlsplit(p.url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return "its --external URL is not a URL (http(s)://HOST[:PORT]/PATH)"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "its --external URL must be http(s)://HOST[:PORT]/PATH, the base URL its OpenAI clients use"
    if parts.username or parts.password or parts.query or parts.fragment:
        return (
            "its --external URL carries credentials, a query or a fragment: give the plain base URL, and the "
            "key in an environment variable of the router named by --key-env"
        )
    if not p.key_env:
        return "it names no key: --key-env VAR, the router's environment variable that holds the provider's key"
    for i, name in enumerate(p.key_env, 1):
        if not _ENV_NAME.match(name):
            return (
                f"--key-env #{i} is not an environment variable's name (letters, digits, '_'): name the variable "
                "that holds the key (OPENAI_API_KEY), never the key itself"
            )
    if len(set(p.key_env)) != len(p.key_env):
        return "--key-env names a variable twice"
    if p.model is not None and not p.model.strip():
        return "--upstream-model is empty"
    if (p.input_usd_per_m is None) != (p.output_usd_per_m is None):
        return "give both prices (--price-in and --price-out) or neither"
    for v in (p.input_usd_per_m, p.output_usd_per_m):
        if v is not None and not v >= 0:
            return "a price per million tokens must be 0 or more"
    return None


def cheapest_first(providers: list[ExternalProvider]) -> list[ExternalProvider]:
    """The order the routers try a model's providers in: by input plus output price per million tokens
    (a provider without prices counts as free), ties in the order they are listed. Pure."""
    return sorted(providers, key=lambda p: (p.input_usd_per_m or 0.0) + (p.output_usd_per_m or 0.0))


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model as an operator declares it (CAT-1). An ``external`` model is served by the providers
    listed there (GW-12): it has no source and no profiles, and nothing is ever placed for it."""

    name: str
    source: str = ""  # a local path on the nodes, or ``mirror:MODEL/VERSION/FILE`` (fetched by the agents)
    aliases: list[str] = []
    description: str = ""
    route: str = "chat"
    context_length: int | None = None
    max_output: int | None = None
    fallbacks: list[str] = []
    scaling: Scaling = Scaling()
    capacity_class: str | None = None
    owner: str | None = None
    profiles: list[Profile] = []
    slo: Slo | None = None
    external: list[ExternalProvider] = []  # providers outside the cluster, tried cheapest first


MIRROR_SCHEME = "mirror:"
_MIRROR_PART = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


def mirror_ref(source: str) -> str | None:
    """``MODEL/VERSION/FILE`` of a ``mirror:`` source; None for a local path.

    Raises ValueError for a ``mirror:`` source that is not three plain names (no ``..``, no empty parts).
    """
    if not source.startswith(MIRROR_SCHEME):
        return None
    ref = source[len(MIRROR_SCHEME) :]
    parts = ref.split("/")
    if len(parts) != 3 or not all(_MIRROR_PART.match(p) and p not in (".", "..") for p in parts):
        raise ValueError(f"source {source!r} is not mirror:MODEL/VERSION/FILE (as `llmgw mirror list` shows the files)")
    return ref


def spec_hash(spec: ModelSpec) -> str:
    """What a running replica depends on: a replica started from another hash is a stale profile (CAT-5)."""
    import hashlib

    relevant = (spec.source, spec.profiles, spec.context_length)
    return hashlib.sha256(msgspec.json.encode(relevant)).hexdigest()[:16]


class ModelAdded(msgspec.Struct, frozen=True, kw_only=True):
    spec: ModelSpec
    declared: bool = False  # from the config file: edited there, not at runtime


class ModelChanged(msgspec.Struct, frozen=True, kw_only=True):
    spec: ModelSpec
    what: str = ""


class ModelScaled(msgspec.Struct, frozen=True, kw_only=True):
    min: int
    max: int


class ModelStopped(msgspec.Struct, frozen=True, kw_only=True):
    saved_min: int
    saved_max: int


class ModelStarted(msgspec.Struct, frozen=True, kw_only=True):
    min: int
    max: int


class ModelRemoved(msgspec.Struct, frozen=True, kw_only=True):
    purge: bool = False


class ModelParked(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    failures: int


class ModelRetried(msgspec.Struct, frozen=True, kw_only=True):
    """Unparked by `ctl retry`: placement is tried again at once."""


class ModelPreempted(msgspec.Struct, frozen=True, kw_only=True):
    """Replicas of this model gave way to a model of a higher class, or of its own class below its
    minimum (SCHED-7). Written by the scheduler beside the stop requests of those replicas; the model
    is then held back from placement until ``held_until`` or until ``for_model`` is placed."""

    replicas: list[str]
    node_id: str
    capacity_class: str  # this model's class when it gave way
    for_model: str
    for_class: str
    reason: str
    at: float  # the scheduler's clock (epoch seconds) when it decided: the hold counts from it
    held_until: float


class ModelAutoscaled(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler moved the replicas a model holds between its min and max with the load (SCHED-9).
    ``added`` is how many replicas the load holds above the minimum after this step; it and ``at``
    are what a new leader needs to go on (one step at a time, the idle window counted from it)."""

    from_: int = msgspec.field(name="from")
    to: int
    added: int
    reason: str  # with the load that caused it: "3 requests waiting on 1 ready replica for 60 s"
    at: float  # the scheduler's clock (epoch seconds) when it decided


class NodeShape(msgspec.Struct, frozen=True, kw_only=True):
    """What a measurement depends on in the node it ran on (SCHED-10): its CPUs and its GPUs' model."""

    cpus: int = 0
    gpu: str = ""  # the GPUs' model ("NVIDIA H200"); "" on a node without GPUs
    gpus: int = 0

    def words(self) -> str:
        cpus = f"{self.cpus} CPUs"
        return f"{self.gpus}× {self.gpu}, {cpus}" if self.gpus else cpus


def node_shape(cpus: int | None, gpu_names: list[str]) -> NodeShape:
    """The shape of a node with ``cpus`` and GPUs named ``gpu_names``; the first GPU's model names them all."""
    return NodeShape(cpus=cpus or 0, gpu=gpu_names[0] if gpu_names else "", gpus=len(gpu_names))


class ModelMeasured(msgspec.Struct, frozen=True, kw_only=True):
    """`ctl bench MODEL --save` (SCHED-10): how many concurrent requests one replica of ``profile`` on a
    node of ``shape`` served within the model's SLO (``basis`` "slo"), or, without an SLO, where its total
    tokens/s stopped rising by 10 % (``basis`` "knee"); the autoscaler and headroom read it."""

    profile: str
    shape: NodeShape
    node_id: str
    replica_id: str
    concurrency: int  # concurrent requests one replica serves
    tokens_per_s: float  # generated tokens per second at that concurrency, all requests together
    ttft_p95_s: float  # time to first token, 95th percentile, at that concurrency
    request_tokens_per_s: float  # the generation speed 95 % of requests saw at least, at that concurrency
    basis: str  # "slo" or "knee"
    slo: Slo | None = None  # the SLO it was measured against: another SLO makes it stale
    requests: int  # requests the measurement sent, every step together
    at: float  # epoch seconds when it finished


MEASUREMENTS_KEPT = 32  # a model's measurements a fold keeps: one per profile and node shape, newest last


def add_measurement(kept: list[ModelMeasured], new: ModelMeasured) -> list[ModelMeasured]:
    """``kept`` with ``new`` last: it replaces the measurement of its profile on its node shape. Pure."""
    others = [x for x in kept if (x.profile, x.shape) != (new.profile, new.shape)]
    return [*others[-(MEASUREMENTS_KEPT - 1) :], new]


class PurgeStarted(msgspec.Struct, frozen=True, kw_only=True):
    """The mirror service took on a ``model.removed{purge}``: what it will delete, and what stays and why."""

    source: str  # the model's source when it was removed
    mirror: list[str] = []  # MODEL/VERSION/FILE deleted from the mirror
    nodes: list[str] = []  # MODEL/VERSION/FILE deleted from every node's weights cache
    kept: dict[str, str] = {}  # MODEL/VERSION/FILE -> why it stays (the models that use it)
    waiting_for: list[str] = []  # replicas of the model still running: nothing is deleted before they stop


class PurgeFileRemoved(msgspec.Struct, frozen=True, kw_only=True):
    where: str  # "mirror", or the node id whose cache held the copy
    file: str  # MODEL/VERSION/FILE


class PurgeFinished(msgspec.Struct, frozen=True, kw_only=True):
    removed: int = 0  # files deleted, over every ``purge_file_removed`` of this purge
    kept: dict[str, str] = {}  # as in ``purge_started``, with files another model took up meanwhile
    unreached: list[str] = []  # nodes that did not answer: `ctl weights --collect` removes their copies later
    note: str = ""


class PurgeFailed(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


PURGE_EVENTS = (PurgeStarted, PurgeFileRemoved, PurgeFinished, PurgeFailed)


MODEL_EVENTS = (
    ModelAdded,
    ModelChanged,
    ModelScaled,
    ModelStopped,
    ModelStarted,
    ModelRemoved,
    ModelParked,
    ModelRetried,
    ModelPreempted,
    ModelAutoscaled,
    ModelMeasured,
)


EVENTS = (
    EventType(
        "model.added",
        1,
        ModelAdded,
        "A model joined the catalog, with its whole definition; an external one (`spec.external`) lists its "
        "providers: base URL, the routers' key variables (never a key), the model's name there, its prices.",
    ),
    EventType("model.changed", 1, ModelChanged, "A model's definition changed (resources, profiles, …)."),
    EventType("model.scaled", 1, ModelScaled, "A model's min and max replicas changed."),
    EventType("model.stopped", 1, ModelStopped, "An administrator stopped a model; its scaling is saved."),
    EventType("model.started", 1, ModelStarted, "A stopped model was started; its scaling restored."),
    EventType("model.removed", 1, ModelRemoved, "A model left the catalog."),
    EventType("model.parked", 1, ModelParked, "The scheduler stopped placing a model after repeated start failures."),
    EventType("model.retried", 1, ModelRetried, "A parked model is to be placed again (`ctl retry`)."),
    EventType(
        "model.preempted",
        1,
        ModelPreempted,
        "Replicas of the model gave way to a model of higher class (or of its class, below its minimum); "
        "the model is held back until the winner is placed or the hold ends.",
    ),
    EventType(
        "model.autoscaled",
        1,
        ModelAutoscaled,
        "The scheduler added or removed a replica of the model with its load (between min and max), saying which load.",
    ),
    EventType(
        "model.measured",
        1,
        ModelMeasured,
        "`ctl bench --save` measured the concurrent requests one replica serves within the model's SLO "
        "(or at its throughput's knee), and its tokens/s there, for a profile on a node shape.",
    ),
    EventType(
        "model.purge_started",
        1,
        PurgeStarted,
        "The mirror service began purging a removed model's files: those it deletes, those it keeps and why.",
    ),
    EventType(
        "model.purge_file_removed",
        1,
        PurgeFileRemoved,
        "One file of a purge was deleted, from the mirror or from one node's weights cache.",
    ),
    EventType("model.purge_finished", 1, PurgeFinished, "A purge is done: how many files went, which stayed."),
    EventType("model.purge_failed", 1, PurgeFailed, "A purge stopped, with a reason a person can act on."),
)


# -- commands ----------------------------------------------------------------------------------


class AddModel(msgspec.Struct, frozen=True, kw_only=True, tag="add", forbid_unknown_fields=True):
    spec: ModelSpec


class ScaleModel(msgspec.Struct, frozen=True, kw_only=True, tag="scale", forbid_unknown_fields=True):
    name: str
    min: int
    max: int | None = None


class SetResources(msgspec.Struct, frozen=True, kw_only=True, tag="resources", forbid_unknown_fields=True):
    name: str
    memory_gb: float | None = None
    cores: int | None = None


class StopModel(msgspec.Struct, frozen=True, kw_only=True, tag="stop", forbid_unknown_fields=True):
    name: str


class StartModel(msgspec.Struct, frozen=True, kw_only=True, tag="start", forbid_unknown_fields=True):
    name: str


class RemoveModel(msgspec.Struct, frozen=True, kw_only=True, tag="remove", forbid_unknown_fields=True):
    name: str
    purge: bool = False  # the mirror service then deletes its mirror files and the nodes' copies (CAT-4)


class RetryModel(msgspec.Struct, frozen=True, kw_only=True, tag="retry", forbid_unknown_fields=True):
    name: str


class SetClass(msgspec.Struct, frozen=True, kw_only=True, tag="class", forbid_unknown_fields=True):
    """CAT-4: the model's capacity class; None: the default (standard)."""

    name: str
    capacity_class: str | None = None


class SetOwner(msgspec.Struct, frozen=True, kw_only=True, tag="owner", forbid_unknown_fields=True):
    """CAT-4: the scope whose capacity quota the model's replicas count against (SCHED-8); None: no owner."""

    name: str
    owner: str | None = None


class SetSlo(msgspec.Struct, frozen=True, kw_only=True, tag="slo", forbid_unknown_fields=True):
    """CAT-1: what each request of the model should get; None for both: no SLO."""

    name: str
    ttft_p95_s: float | None = None
    tokens_per_s: float | None = None


class SaveMeasurement(msgspec.Struct, frozen=True, kw_only=True, tag="measured", forbid_unknown_fields=True):
    """SCHED-10: `ctl bench MODEL --save` records what it measured (a ``model.measured``)."""

    name: str
    measured: ModelMeasured


CatalogCommand = (
    AddModel
    | ScaleModel
    | SetResources
    | StopModel
    | StartModel
    | RemoveModel
    | RetryModel
    | SetClass
    | SetOwner
    | SetSlo
    | SaveMeasurement
)
