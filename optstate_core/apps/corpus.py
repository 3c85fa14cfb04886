"""The demo's text: real source files read at run time, split into training and held-out text by file."""
from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import logging

import torch

from .demo_config import DemoConfig

log = logging.getLogger("optstate.demo")
TEXT_SUFFIXES = (".py",)
HOLDOUT_EVERY = 10  # about one file in ten is held out (chosen by a hash of its name)


# -- data -----------------------------------------------------------------------------------
@dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str
    n_train_files: int
    n_val_files: int


def default_text_dir() -> Path:
    """The standard library's source directory (where ``os.py`` lives)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path) -> List[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"--data: {str(root)!r} is neither a file nor a directory")
    return sorted(p for p in root.glob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def is_held_out(path: Path) -> bool:
    """Held-out files are chosen by a hash of the file name: stable across machines and versions."""
    return zlib.crc32(path.name.encode()) % HOLDOUT_EVERY == 0


def load_corpus(data: Optional[str] = None, max_bytes: int = 4_000_000) -> Corpus:
    """Training and held-out bytes from the ``.py`` files of ``data`` (a directory or one file;
    default: the standard library, else torch's own sources). The held-out text is whole files,
    capped at ``max_bytes // 10``; training text is capped at ``max_bytes``."""
    if data is not None:
        roots = [Path(data)]
    else:  # some Python builds ship the standard library zipped: then read torch's sources
        roots = [default_text_dir(), Path(torch.__file__).parent]
    files: List[Path] = []
    for root in roots:
        files = _text_files(root)
        if files:
            break
    if not files:
        raise ValueError(f"--data: no {'/'.join(TEXT_SUFFIXES)} files found in {', '.join(map(str, roots))}")
    val_files = [f for f in files if is_held_out(f)]
    train_files = [f for f in files if not is_held_out(f)]
    if len(files) == 1:  # one file: its last tenth is the held-out text
        raw = files[0].read_bytes()
        cut = len(raw) - len(raw) // HOLDOUT_EVERY
        train, val = raw[:cut][:max_bytes], raw[cut:][:max(1, max_bytes // HOLDOUT_EVERY)]
        n_train, n_val = 1, 1
    else:
        if not val_files:
            val_files, train_files = train_files[-1:], train_files[:-1]
        if not train_files:
            train_files, val_files = val_files[:-1], val_files[-1:]
        train, n_train = _read_capped(train_files, max_bytes)
        val, n_val = _read_capped(val_files, max(1, max_bytes // HOLDOUT_EVERY))
    corpus = Corpus(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                    torch.frombuffer(bytearray(val), dtype=torch.uint8),
                    str(files[0].parent if len(files) > 1 else files[0]), n_train, n_val)
    log.info("text: %s (%d train files, %.2f MB; %d held-out files, %.2f MB)", corpus.source, n_train,
             len(train) / 1e6, n_val, len(val) / 1e6)
    return corpus


def _read_capped(files: Sequence[Path], cap: int) -> Tuple[bytes, int]:
    parts, total, used = [], 0, 0
    for f in files:
        if total >= cap:
            break
        raw = f.read_bytes()
        parts.append(raw[:cap - total])
        total += len(parts[-1])
        used += 1
    return b"".join(parts), used


def train_offsets(corpus: Corpus, cfg: DemoConfig) -> torch.Tensor:
    """Start offsets of every training window, ``[steps, batch]``: a function of the seed only."""
    high = len(corpus.train) - cfg.seq_len - 1
    if high < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than the training text ({len(corpus.train)} bytes)")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, high, (cfg.steps, cfg.batch_size), generator=g)


def val_offsets(corpus: Corpus, cfg: DemoConfig) -> torch.Tensor:
    """Evenly spaced held-out windows, ``[eval_batches, batch]`` (the same for every seed)."""
    high = len(corpus.val) - cfg.seq_len - 1
    if high < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than the held-out text ({len(corpus.val)} bytes)")
    n = cfg.eval_batches * cfg.batch_size
    return torch.linspace(0, high, n).long().view(cfg.eval_batches, cfg.batch_size)


def windows(text: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(offsets), seq_len + 1]`` int64 byte windows."""
    idx = offsets.view(-1, 1) + torch.arange(seq_len + 1)
    return text[idx].long()
