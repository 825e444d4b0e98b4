"""The registry of residual topologies: one :class:`Topology` per name, registered by the module that defines it.

A registration says everything a model needs: the block class (and its options) at each depth, how the streams
start and end, the options with their one default, which families offer it, its colour in figures. Every list of
topologies, every option default and every per-topology choice elsewhere is derived from here.
:func:`resolve_topology` turns a name, a depth and a model's keyword options into a :class:`TopologyPlan`, the one
object a model builds its blocks, streams and output from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from torch import nn

from common.cli import InputError
from common.config import did_you_mean
from common.topologies.base import NormLayer, ResidualBlock, SingleStream, default_norm, single_stream_output

FAMILIES = ("deit", "dit")
FAMILY_NAMES = {"deit": "DeiT", "dit": "DiT"}
BlockSpec = Tuple[Type[ResidualBlock], Dict[str, Any]]


def _single_stream(plan: "TopologyPlan", dim: int) -> nn.Module:
    return SingleStream()


def _single_stream_output(plan: "TopologyPlan", dim: int, norm_layer: NormLayer, final_norm: bool) -> nn.Module:
    return single_stream_output(dim, norm_layer, final_norm, plan.blocks[-1][0] if plan.blocks else ResidualBlock)


@dataclass(frozen=True)
class Topology:
    """One residual topology.

    Args:
        name: the word a config, a model name (``deit_tiny_<name>_patch16_224``) and the command lines use.
        summary: one line: what it computes.
        blocks: ``blocks(depth, options) -> [(block class, its keyword arguments)] * depth``; ``options`` holds every
            option of :attr:`options`, defaults filled in.
        options: the model keyword arguments it reads, each with its one default (None: derived from the depth by
            ``blocks``).
        streams: ``streams(plan, dim) ->`` the :class:`~common.topologies.base.StreamStart` that turns the embedding into
            the first block's state and says what a state holds.
        output: ``output(plan, dim, norm_layer, final_norm) -> module`` between the last block and the head.
        families: the model families that offer it.
        color: its colour in every figure.
        init_weights: applied to a model's blocks after the model's own init (DeepNorm's scaled weights).
        model_defaults: ``model_defaults(depth) -> {argument: value}``, DeiT constructor arguments it sets when the
            user gave none (LayerScale's ``init_values``, DyT's ``norm_layer``).
    """

    name: str
    summary: str
    blocks: Callable[[int, Dict[str, Any]], List[BlockSpec]]
    color: str
    options: Mapping[str, Any] = field(default_factory=dict)
    streams: Callable[["TopologyPlan", int], nn.Module] = _single_stream
    output: Callable[..., nn.Module] = _single_stream_output
    families: Tuple[str, ...] = FAMILIES
    init_weights: Optional[Callable[[Sequence[nn.Module]], None]] = None
    model_defaults: Optional[Callable[[int], Dict[str, Any]]] = None


TOPOLOGIES: Dict[str, Topology] = {}


def register(topology: Topology) -> Topology:
    if topology.name in TOPOLOGIES:
        raise ValueError(f"topology {topology.name!r} is registered twice")
    unknown = set(topology.families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"topology {topology.name!r}: unknown families {sorted(unknown)}")
    TOPOLOGIES[topology.name] = topology
    return topology


def topology_names(family: Optional[str] = None) -> Tuple[str, ...]:
    """The registered topologies (those ``family`` offers), in registration order."""
    return tuple(name for name, t in TOPOLOGIES.items() if family is None or family in t.families)


def topology_modules(family: Optional[str] = None) -> Tuple[str, ...]:
    """The modules whose registrations make up :func:`topology_names` (``family``): where each ``blocks`` lives."""
    return tuple(dict.fromkeys(TOPOLOGIES[name].blocks.__module__ for name in topology_names(family)))


def option_names() -> Tuple[str, ...]:
    """Every option any topology reads (the model keyword arguments that are topology options)."""
    return tuple(dict.fromkeys(o for t in TOPOLOGIES.values() for o in t.options))


def check_topology(name: str, family: Optional[str] = None) -> Topology:
    """The registered topology ``name`` (offered by ``family``), or one line naming the valid ones."""
    allowed = topology_names(family)
    if name in allowed:
        return TOPOLOGIES[name]
    if name in TOPOLOGIES:
        raise InputError(f"the {name} topology is not offered for {FAMILY_NAMES[family]}; valid topologies are "
                         f"{', '.join(allowed)}")
    raise InputError(f"unknown residual topology {name!r}{did_you_mean(name, allowed)}; valid topologies are "
                     f"{', '.join(allowed)}")


@lru_cache(maxsize=None)
def block_class(family: Type[ResidualBlock], base: Type[ResidualBlock]) -> Type[ResidualBlock]:
    """The block class of ``family`` (a model's sublayers) on ``base``'s wiring, e.g.
    ``SiameseNormDeiTBlock(DeiTBlock, SiameseNormBlock)``; one class per pair."""
    name = base.__name__[: -len("Block")] + family.__name__
    return type(name, (family, base), {"__module__": family.__module__, "__qualname__": name,
                                        "__doc__": f"{family.__name__} on {base.__name__}: {base.__doc__}"})


@dataclass(frozen=True)
class TopologyPlan:
    """A topology resolved for a model of ``depth`` blocks: its options (defaults filled in) and the block class
    and keyword arguments of each depth. A model builds its blocks, streams and output from it alone."""

    topology: Topology
    depth: int
    options: Dict[str, Any]
    blocks: Tuple[BlockSpec, ...]

    @property
    def name(self) -> str:
        return self.topology.name

    @property
    def block_topologies(self) -> List[str]:
        """The topology of each block (Mix-LN: ``post`` then ``pre``)."""
        return [cls.topology for cls, _ in self.blocks]

    def build_block(self, family: Type[ResidualBlock], index: int, *args, **kwargs) -> ResidualBlock:
        """Block ``index`` with ``family``'s sublayers; ``args`` and ``kwargs`` go to ``family``'s constructor
        (which passes what it does not read on to the topology's)."""
        base, options = self.blocks[index]
        return block_class(family, base)(*args, **kwargs, **options)

    def streams(self, dim: int) -> nn.Module:
        return self.topology.streams(self, dim)

    def output(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True) -> nn.Module:
        """The module the head reads through: the streams' fusion, or a single stream's final norm when
        ``final_norm`` (DiT: False, its final layer normalises)."""
        return self.topology.output(self, dim, norm_layer, final_norm)

    def init_weights(self, blocks: Sequence[nn.Module]) -> None:
        if self.topology.init_weights is not None:
            self.topology.init_weights(blocks)

    def model_defaults(self) -> Dict[str, Any]:
        return self.topology.model_defaults(self.depth) if self.topology.model_defaults else {}


def resolve_topology(name: str, depth: int, family: Optional[str] = None, **options) -> TopologyPlan:
    """``name`` with ``options`` (a model's topology keyword arguments) for ``depth`` blocks. An option the topology
    does not read is refused, naming the topologies that do: a setting is never silently ignored."""
    topology = check_topology(name, family)
    foreign = [k for k in options if k not in topology.options]
    if foreign:
        readers = {k: [t.name for t in TOPOLOGIES.values() if k in t.options] for k in foreign}
        said = "; ".join(f"{k} is an option of {', '.join(r)}" if r else f"{k} is no topology option"
                         for k, r in readers.items())
        own = ", ".join(topology.options) or "none"
        raise InputError(f"the {name} topology has no option {', '.join(foreign)} ({said}); its options: {own}")
    resolved = {**topology.options, **options}
    return TopologyPlan(topology, depth, resolved, tuple(topology.blocks(depth, resolved)))
