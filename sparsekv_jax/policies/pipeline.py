"""Composition: one policy per stage, e.g. ``Pipeline(prefill=Stem(), compress=SnapKV(0.2),
decode=Quest(0.25))``, still one jitted `generate` call (a ``context`` stage runs before it)."""

from __future__ import annotations

from typing import Any

from flax import struct

from sparsekv_jax.policies.base import DENSE, STAGES, Dense, Policy, Setup

# The hooks of each stage: `Pipeline` forwards each to the policy of its stage (generated below,
# not written out per hook). `generate` itself calls ``policy.stage(name).hook(...)``.
STAGE_HOOKS: dict[str, tuple[str, ...]] = {
    "context": ("context",),
    "prefill": ("prefill_pattern",),
    "compress": ("observe", "compressed_capacity", "compress"),
    "decode": ("decode_init", "decode_write", "decode_appends", "decode_select", "decode_observe", "decode_update",
               "decode_rewind", "decode_stats"),
}


@struct.dataclass
class Pipeline(Policy):
    """Delegates each stage to the policy given for it (`Dense`, i.e. identity, where none is).

    ``Pipeline(context=S3Hybrid(), prefill=Stem(), compress=SemantiCache(0.2), decode=CHESS())``.
    A member may implement several stages (H2O compresses and evicts while decoding); it runs only
    the stage it is given here. A decode policy that needs prefill observations gets its own
    (``observe`` runs for every member that ``needs_observations``).
    """

    members: tuple[Policy, Policy, Policy, Policy] = (DENSE, DENSE, DENSE, DENSE)

    def __init__(self, context: Policy | None = None, prefill: Policy | None = None,
                 compress: Policy | None = None, decode: Policy | None = None, *,
                 members: tuple[Policy, ...] | None = None) -> None:
        if members is None:  # (members= is how the pytree machinery rebuilds one)
            members = (context, prefill, compress, decode)
            for stage, pol in zip(STAGES, members, strict=True):
                if pol is not None and not isinstance(pol, Policy):
                    raise ValueError(f"Pipeline {stage}={pol!r} is not a Policy")
                if isinstance(pol, Pipeline):
                    raise ValueError(f"Pipeline {stage}= cannot be another Pipeline")
                if pol is not None and type(pol) is not Dense and stage not in pol.stages:
                    raise ValueError(f"Pipeline {stage}={pol.name}: {pol.name} implements {list(pol.stages)}, "
                                     f"not the {stage} stage")
            members = tuple(DENSE if p is None else p for p in members)
        object.__setattr__(self, "members", tuple(members))

    def stage(self, name: str) -> Policy:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {STAGES}")
        return self.members[STAGES.index(name)]

    @property
    def stages(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(s for s, p in zip(STAGES, self.members, strict=True) if type(p) is not Dense)

    @property
    def name(self) -> str:
        return "Pipeline(" + ", ".join(f"{s}={self.stage(s).name}" for s in self.stages) + ")"

    def _any(self, need: str) -> bool:
        return any(getattr(p, need) for p in self.members)

    @property
    def needs_whole_prefill(self) -> bool:  # type: ignore[override]
        return self._any("needs_whole_prefill")

    @property
    def needs_observations(self) -> bool:  # type: ignore[override]
        return self._any("needs_observations")

    @property
    def needs_decode_probs(self) -> bool:  # type: ignore[override]
        return self.stage("decode").needs_decode_probs

    @property
    def needs_question(self) -> bool:  # type: ignore[override]
        return self._any("needs_question")

    @property
    def max_rewind_tokens(self) -> int:
        return self.stage("decode").max_rewind_tokens

    # the declarations of one stage are its member's (`Policy`'s docstring): a page pool reads them
    @property
    def writes_entries(self) -> bool:  # type: ignore[override]
        return self.stage("compress").writes_entries

    @property
    def selects_pages(self) -> bool:  # type: ignore[override]
        return self.stage("decode").selects_pages

    @property
    def writes_in_place(self) -> bool:  # type: ignore[override]
        return self.stage("decode").writes_in_place

    @property
    def page_summaries(self) -> frozenset[str]:  # type: ignore[override]
        """Every page summary a member reads (whatever stage reads it)."""
        return frozenset().union(*(p.page_summaries for p in self.members))

    @classmethod
    def covering(cls) -> Pipeline:
        return cls()

    def bind(self, setup: Setup) -> Pipeline:
        return Pipeline(members=tuple(p.bind(setup) for p in self.members))

    def with_tokenizer(self, tokenizer: Any) -> Pipeline:
        return Pipeline(members=tuple(p.with_tokenizer(tokenizer) for p in self.members))


def _forward(hook: str, stage: str):
    def method(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.stage(stage), hook)(*args, **kwargs)

    method.__name__ = hook
    method.__doc__ = f"``{hook}`` of the {stage} stage's policy."
    return method


for _stage, _hooks in STAGE_HOOKS.items():
    for _hook in _hooks:
        setattr(Pipeline, _hook, _forward(_hook, _stage))
