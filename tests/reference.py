"""Plain torch references that the kernels are tested against."""
import torch


def u8_blocks(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A contiguous tensor as [num_blocks, block_bytes] uint8 (a view)."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    return flat.view(-1, block_bytes)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids, block_bytes: int) -> torch.Tensor:
    """Returns what dst must hold afterwards: dst block d_i = src block s_i, rest unchanged."""
    s = u8_blocks(src.cpu(), block_bytes)
    out = u8_blocks(dst.cpu().clone(), block_bytes)
    for a, b in zip(list(src_ids), list(dst_ids)):
        out[int(b)] = s[int(a)]
    return out


def random_bytes(shape, device="cpu", seed=0, dtype=torch.uint8, pin=False) -> torch.Tensor:
    """Random non-zero bytes (never zeros: zeros hide unwritten output)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = 1
    for s in shape:
        nbytes *= s
    x = torch.randint(1, 256, (nbytes,), generator=g, dtype=torch.int32).to(torch.uint8)
    if pin:
        x = x.pin_memory()
    x = x.to(device) if device != "cpu" else x
    return x


POISON = 0xA5


def poisoned(nbytes: int, device="cpu", pin=False) -> torch.Tensor:
    t = torch.full((nbytes,), POISON, dtype=torch.uint8)
    if pin:
        t = t.pin_memory()
    return t.to(device) if device != "cpu" else t
