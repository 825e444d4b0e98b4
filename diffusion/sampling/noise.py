"""Each sample's own noise stream: sample ``i`` draws its x_T and every step's noise from a stream seeded by
``(seed, i)`` (numpy's ``SeedSequence``), so a sample is the same whatever batch, chunk or process it is drawn in."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, List, Sequence

import numpy as np
import torch

Tensor = torch.Tensor
NOISE_WINDOW = 16  # reverse-chain draws per torch call and sample (a DiT-XL chunk of 64: 16 MB a window)

_SEED_MASK = 0xFFFFFFFF
# numpy's SeedSequence constants (numpy/random/bit_generator.pyx): hashing entropy in, mixing the pool, drawing out
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715


def sample_seeds(seed: int, indices) -> np.ndarray:
    """``np.random.SeedSequence([seed, i]).generate_state(1)[0]`` for every index ``i`` at once (uint32).

    numpy's SeedSequence hashes its entropy words with fixed 32-bit multiply-xorshift rounds; for ``seed`` and
    indices below 2**32 the entropy is the two words ``[seed, i]``, and the same rounds run here on arrays.
    Larger values fall back to numpy itself.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not (0 <= seed <= _SEED_MASK) or (idx.size and (idx.min() < 0 or idx.max() > _SEED_MASK)):
        return np.array([np.random.SeedSequence([int(seed), int(i)]).generate_state(1)[0] for i in idx], np.uint32)
    u32 = np.uint32
    hash_const = [_INIT_A]  # advances with every hash, the same for every sample

    def hashmix(value):
        value = value ^ u32(hash_const[0])
        hash_const[0] = (hash_const[0] * _MULT_A) & _SEED_MASK
        value = value * u32(hash_const[0])
        return value ^ (value >> u32(16))

    def mix(x, y):
        result = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return result ^ (result >> u32(16))

    words = [np.full(idx.shape, seed, u32), idx.astype(u32), np.zeros(idx.shape, u32), np.zeros(idx.shape, u32)]
    pool = [hashmix(w) for w in words]  # the pool of 4 words, each entropy word hashed in
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    state = (pool[0] ^ u32(_INIT_B)) * u32((_INIT_B * _MULT_B) & _SEED_MASK)  # generate_state(1): the first word
    return state ^ (state >> u32(16))


def sample_generators(seed: int, indices) -> List[torch.Generator]:
    """The noise stream of each global sample index: independent of batching and of the number of processes."""
    return [torch.Generator().manual_seed(int(s)) for s in sample_seeds(seed, indices)]


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int]) -> Tensor:
    """One standard normal draw of ``shape`` from each sample's stream (on the CPU), stacked into a batch."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


def chain_noise(generators: Sequence[torch.Generator], shape: Sequence[int], draws: int, device,
                window: int = NOISE_WINDOW) -> Iterator[Tensor]:
    """``draws`` successive :func:`draw_noise` batches, on ``device``, with the same numbers.

    Each sample's stream gives ``window`` draws per torch call: torch's CPU normal sampler fills blocks of 16
    values, so one draw of ``window * numel`` values is ``window`` draws of ``numel`` when 16 divides ``numel``
    (otherwise each draw is its own call). The next window is drawn by a worker thread while the chain runs on the
    current one, and on CUDA it goes through pinned memory with a non-blocking copy: the host never waits for the
    device to take the noise, and the device never waits for the host to draw it.
    """
    shape = tuple(shape)
    window = window if math.prod(shape) % 16 == 0 else 1
    device = torch.device(device)
    pinned = device.type == "cuda"
    sizes = [min(window, draws - done) for done in range(0, draws, window)]

    def draw(n: int) -> Tensor:
        buffer = torch.empty((len(generators), n, *shape), pin_memory=pinned)  # (B, draws, C, H, W)
        for row, g in zip(buffer, generators):
            torch.randn((n, *shape), generator=g, out=row)  # straight into the sample's contiguous rows
        return buffer

    with ThreadPoolExecutor(max_workers=1) as worker:
        pending = worker.submit(draw, sizes[0]) if sizes else None
        for k in range(len(sizes)):
            buffer = pending.result()
            if k + 1 < len(sizes):
                pending = worker.submit(draw, sizes[k + 1])
            block = buffer.to(device, non_blocking=pinned)  # (B, draws, C, H, W)
            for j in range(block.shape[1]):
                yield block[:, j]  # (B, C, H, W)
