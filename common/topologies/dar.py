"""Diffusion-Adaptive Routing (``dar``, arXiv 2605.20708) and SiameseNorm with it (``siamese_dar``), for DiT.

DAR replaces the residual add with routing over depth: every sublayer output joins a history, and each sublayer
reads a softmax-weighted mix of it, with a query that may depend on the timestep::

    h_k = sum_i alpha_{i->k} v_i,   alpha_{i->k} = softmax_i(q_k . RMSNorm(v_i) / sqrt(D))
    v_0 = the embedding,  v_{k+1} = F_k(h_k)          (DiT: gate * F(modulate(LN(h_k))))
    q_k = w_k (static),  w_k + E t_emb (static_t),  W_k v_k (dynamic)

``w_k``, ``E`` and ``W_k`` are zero at init (every sublayer starts reading the mean of its sources; static_t starts
static). Chunked (``dar_chunk = S``): the outputs fall into chunks of ``S`` sublayers; a sublayer reads ``v_0``, the
summary of each finished chunk (its last output) and the outputs of its own chunk so far. The final layer reads one
more routing over ``v_0``, the summaries and the last chunk's outputs. The state is ``(history, E t_emb or None)``.

``siamese_dar`` keeps SiameseNorm's Post-Norm stream ``X`` and routes its Pre-Norm stream: ``Y``, the embedding plus
every ``Z``, becomes the routed mix of the history of ``Z``'s (docs/method.md). At init the mix is the history's
mean, ``Y / (k + 1)``, which ``LN_pre`` normalises to what SiameseNorm reads.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from common.cli import InputError
from common.topologies.base import LN_EPS, NormLayer, ResidualBlock, StreamFusion, StreamStart, default_norm
from common.topologies.fused_routing import routed_mix
from common.topologies.registry import BlockSpec, Topology, register
from common.topologies.siamese import SiameseFusion, SiameseNormBlock

Tensor = torch.Tensor
History = Tuple[List[Tensor], Optional[Tensor]]
QUERIES = ("static", "static_t", "dynamic")


class DepthRouter(nn.Module):
    """One reader's routing over the history: ``sum_i softmax_i(q . RMSNorm(v_i) / sqrt(D)) v_i``.

    Written per source, ``(v_i . q) / rms(v_i)``, so nothing of ``(sources, B, T, D)`` is stacked. The dynamic
    query's ``W`` is a parameter, not an ``nn.Linear``, so that a model's init of its linears leaves it at zero.
    """

    def __init__(self, dim: int, query: str, eps: float = LN_EPS):
        super().__init__()
        self.dynamic = query == "dynamic"
        self.eps, self.scale = eps, dim ** -0.5
        if self.dynamic:
            self.query_weight = nn.Parameter(torch.zeros(dim, dim))
        else:
            self.query = nn.Parameter(torch.zeros(dim))

    def forward(self, sources: List[Tensor], time_query: Optional[Tensor]) -> Tensor:
        if self.dynamic:  # (B, T, D) from the newest output
            query = F.linear(sources[-1], self.query_weight)
        elif time_query is None:  # (D,)
            query = self.query
        else:  # (B, 1, D): one query per sample
            query = (self.query + time_query).unsqueeze(1)
        return routed_mix(sources, query, self.eps, self.scale)

    def extra_repr(self) -> str:
        return f"dynamic={self.dynamic}"


class FirstSource(nn.Module):
    """The first sublayer's router: its history is the embedding alone, whose weight is 1."""

    def forward(self, sources: List[Tensor], time_query: Optional[Tensor]) -> Tensor:
        return sources[0]


def chunked(sources: List[Tensor], sublayer_index: int, chunk: int) -> List[Tensor]:
    """The history sublayer ``sublayer_index`` reads: when it starts a new chunk, the finished chunk's ``chunk``
    outputs (the newest sources) give way to its summary, their last; ``chunk=0``: the whole history."""
    if chunk and sublayer_index and sublayer_index % chunk == 0:
        return sources[:-chunk] + sources[-1:]
    return sources


def _routers(block: nn.Module, dim: int, layer_index: int, query: str, chunk: int) -> None:
    """``router{1,2}`` of block ``layer_index`` (block 0's first reads the embedding alone) and the chunk."""
    block.chunk = chunk
    block.router1 = DepthRouter(dim, query) if layer_index > 0 else FirstSource()
    block.router2 = DepthRouter(dim, query)


class DiffusionAdaptiveRoutingBlock(ResidualBlock):
    """DAR: ``Z <- F(LN(route_k(history)))``; ``history <- history + [Z]`` (no residual add). Routers
    ``router{1,2}``, norms ``norm{1,2}`` as Pre-Norm's."""

    topology = "dar"

    def __init__(self, dim: int, layer_index: int = 0, *, query: str, chunk: int,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        _routers(self, dim, layer_index, query, chunk)
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)

    def forward(self, state: History, ctx: Optional[Tensor] = None) -> History:
        sources, time_query = state
        k = 2 * self.layer_index
        sources = chunked(sources, k, self.chunk)
        z = self.drop_path(self.sublayer1(self.norm1(self.router1(sources, time_query)), ctx))
        sources = chunked(sources + [z], k + 1, self.chunk)
        z = self.drop_path(self.sublayer2(self.norm2(self.router2(sources, time_query)), ctx))
        return sources + [z], time_query

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk={self.chunk}"


class SiameseRoutingBlock(SiameseNormBlock):
    """SiameseNorm with its Pre-Norm stream routed::

        X <- LN_post(X);  Z <- F(LN_in(X + LN_pre(route_k(history))));  X <- X + Z / c_l;  history <- history + [Z]

    Norms as :class:`SiameseNormBlock`'s, routers ``router{1,2}``."""

    topology = "siamese_dar"

    def __init__(self, dim: int, layer_index: int = 0, *, query: str, chunk: int,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0):
        super().__init__(dim, layer_index, normalized_input=True, depth_scaling=True, norm_layer=norm_layer,
                         input_norm_layer=input_norm_layer, drop_path=drop_path)
        _routers(self, dim, layer_index, query, chunk)

    def forward(self, state: Tuple[Tensor, List[Tensor], Optional[Tensor]], ctx: Optional[Tensor] = None):
        x, sources, time_query = state
        k = 2 * self.layer_index
        sources = chunked(sources, k, self.chunk)
        x, h = self.norm_chain1(x, self.router1(sources, time_query))
        z = self.drop_path(self.sublayer1(h, ctx))
        x, sources = x.add(z, alpha=1.0 / self.depth_scale), chunked(sources + [z], k + 1, self.chunk)
        x, h = self.norm_chain2(x, self.router2(sources, time_query))
        z = self.drop_path(self.sublayer2(h, ctx))
        return x.add(z, alpha=1.0 / self.depth_scale), sources + [z], time_query

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk={self.chunk}"


class RoutingHistory(StreamStart):
    """The first state ``([embedding], E t_emb + b)``; ``E`` and ``b`` (``time_weight``, ``time_bias``: zero at init,
    shared by every router) only for the static_t query, else ``None`` in its place."""

    def __init__(self, dim: int, query: str):
        super().__init__()
        self.timed = query == "static_t"
        if self.timed:
            self.time_weight = nn.Parameter(torch.zeros(dim, dim))
            self.time_bias = nn.Parameter(torch.zeros(dim))

    def time_offset(self, cond: Optional[Tensor]) -> Optional[Tensor]:
        if not self.timed:
            return None
        if cond is None:
            raise InputError("the static_t routing query reads the timestep embedding, which this model does not pass")
        return F.linear(cond, self.time_weight, self.time_bias)

    def forward(self, x: Tensor, cond: Optional[Tensor] = None) -> History:
        return [x], self.time_offset(cond)

    def accumulated(self, state: History) -> Tensor:
        """The sum of the history (the embedding plus every update while no chunk was summarised)."""
        total = state[0][0]
        for source in state[0][1:]:
            total = total + source
        return total

    def named_streams(self, state: History) -> Dict[str, Tensor]:
        return {"v": state[0][-1]}


class SiameseRoutingHistory(RoutingHistory):
    """``(X, [embedding], E t_emb)``: SiameseNorm's ``X`` starts as the embedding, as the history does."""

    def forward(self, x: Tensor, cond: Optional[Tensor] = None):
        return x, [x], self.time_offset(cond)

    def accumulated(self, state) -> Tensor:
        return super().accumulated(state[1:])

    def named_streams(self, state) -> Dict[str, Tensor]:
        return {"x": state[0], "v": state[1][-1]}


class RoutingFusion(StreamFusion):
    """DAR's output: one more routing over the history (its own router), then ``LN_out`` (``final_norm=False``:
    none, DiT)."""

    def __init__(self, dim: int, query: str, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.router = DepthRouter(dim, query)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, state: History, final_norm: bool = True) -> Tensor:
        h = self.router(*state)
        return self.norm_out(h) if final_norm else h


class SiameseRoutingFusion(SiameseFusion):
    """``LN_out(LN_x(X) + LN_y(route(history)))``: SiameseNorm's fusion with its ``Y`` routed (own router)."""

    def __init__(self, dim: int, query: str, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__(dim, norm_layer, final_norm)
        self.router = DepthRouter(dim, query)

    def forward(self, state, final_norm: bool = True) -> Tensor:
        x, sources, time_query = state
        return super().forward((x, self.router(sources, time_query)), final_norm)


def _routed(block: type):
    def blocks(depth: int, options: Dict[str, Any]) -> List[BlockSpec]:
        query, chunk = options["dar_query"], options["dar_chunk"]
        if query not in QUERIES:
            raise InputError(f"dar_query={query!r} is not a routing query; choose one of {', '.join(QUERIES)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise InputError(f"dar_chunk={chunk!r} must be a whole number of sublayers >= 0 (0: no chunks)")
        return [(block, dict(query=query, chunk=chunk))] * depth

    return blocks


ROUTING_OPTIONS = dict(dar_query="static_t", dar_chunk=4)
register(Topology(
    "dar", "Diffusion-Adaptive Routing: each sublayer reads a timestep-aware softmax mix of the history of outputs",
    _routed(DiffusionAdaptiveRoutingBlock), color="teal", options=ROUTING_OPTIONS, families=("dit",),
    streams=lambda plan, dim: RoutingHistory(dim, plan.options["dar_query"]),
    output=lambda plan, dim, norm_layer, final_norm: RoutingFusion(dim, plan.options["dar_query"], norm_layer,
                                                                    final_norm)))
register(Topology(
    "siamese_dar", "SiameseNorm whose Pre-Norm stream is DAR's routed mix of the history of updates",
    _routed(SiameseRoutingBlock), color="olivedrab", options=ROUTING_OPTIONS, families=("dit",),
    streams=lambda plan, dim: SiameseRoutingHistory(dim, plan.options["dar_query"]),
    output=lambda plan, dim, norm_layer, final_norm: SiameseRoutingFusion(dim, plan.options["dar_query"],
                                                                           norm_layer, final_norm)))
