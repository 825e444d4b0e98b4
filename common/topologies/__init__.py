"""The residual topologies of a two-sublayer transformer block, one module per mechanism, one registration each.

* :mod:`~common.topologies.base`: the block a topology subclasses, the norms, the stream state's two ends;
* :mod:`~common.topologies.registry`: :class:`Topology` (a registration), :func:`resolve_topology` (a topology
  with its options, for a model of some depth: a :class:`TopologyPlan`), and every list derived from them;
* :mod:`~common.topologies.norm_placement`: ``pre``, ``post``, ``siamese`` (:mod:`~common.topologies.siamese`,
  with its fused norm chain in :mod:`~common.topologies.fused_norm_chain`), ``mixln``, ``residual``, ``sandwich``,
  ``deepnorm``, ``layerscale``, ``dyt``;
* :mod:`~common.topologies.stream_mixing`: ``hc``, ``mhc``;
* :mod:`~common.topologies.depth_routing`: ``attnres``, ``attnres_block``;
* :mod:`~common.topologies.dar`: ``dar``, ``siamese_dar`` (DiT).

A model (``vision.deit``, ``diffusion.models``) resolves its topology once and builds from the plan::

    plan = resolve_topology("siamese", depth=12, family="dit", depth_scaling=False)
    blocks = [plan.build_block(DiTBlock, i, hidden_size, num_heads, layer_index=i) for i in range(12)]
    streams, output = plan.streams(hidden_size), plan.output(hidden_size, final_norm=False)

A new topology is one module that defines its block (a :class:`ResidualBlock` subclass whose ``forward`` is its
update) and registers a :class:`Topology`, plus its import below.
"""
from common.topologies.base import (LN_EPS, NormLayer, ResidualBlock, SingleStream, StreamFusion, StreamStart,
                                    StreamState, TwoStreams, default_norm, readout)
from common.topologies.registry import (FAMILIES, TOPOLOGIES, Topology, TopologyPlan, block_class, check_topology,
                                        option_names, register, resolve_topology, topology_modules,
                                        topology_names)
from common.topologies import norm_placement, stream_mixing, depth_routing, dar  # noqa: E402,F401  (registrations)
from common.topologies.norm_placement import DyT
from common.topologies.siamese import SiameseFusion, SiameseNormBlock

__all__ = ["LN_EPS", "NormLayer", "ResidualBlock", "SingleStream", "StreamFusion", "StreamStart", "StreamState",
           "TwoStreams",
           "default_norm", "readout", "FAMILIES", "TOPOLOGIES", "Topology", "TopologyPlan", "block_class",
           "check_topology", "option_names", "register", "resolve_topology", "topology_modules", "topology_names",
           "DyT", "SiameseFusion", "SiameseNormBlock"]
