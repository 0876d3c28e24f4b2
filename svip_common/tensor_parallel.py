"""Tensor parallelism: a target larger than one device, as N ranks, each a shard of every layer.

Megatron's split (gpt-fast's tp.py does the same): q/k/v and gate/up are column-parallel (a rank
holds its heads and its share of the MLP's columns), o and down row-parallel (each rank's partial
product, summed by one all-reduce each: the residual stream is whole on every rank); the KV heads
are split too, so a rank's paged pool holds its heads alone (1/N of the KV memory); the embedding
and the LM head are split by vocabulary (a rank embeds the ids in its rows, the sum over ranks is
the embedding; its logits are its rows', gathered once). Each rank reads only its slices of the
safetensors files: no rank ever holds the whole model, not even while loading.

A shard is a model of the same family whose config is the rank's share (heads / N, KV heads / N,
intermediate / N, vocabulary rows / N, head_dim unchanged), so the flat decoder (pool_decoder.py)
and the paged pool (kv_cache.py) run it as they run any model; ``model.svip_tp`` names its place
and its group, and the decoder sums, and gathers, through it. Rank 0 plans every step (sessions,
pages, positions, tokens) and sends the plan; the other ranks follow it (``KVPool.follow``).

The group is gloo on CPUs, NCCL on GPUs, joined at rank 0's address (127.0.0.1 where the ranks are
local). Runs in every process of a rank."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pickle
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from svip_common.errors import InvalidRequest, ModelLoadError, RankLost
from svip_common.pair_config import check_tp_degree

SHARD_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")
GROUP_TIMEOUT_S = 120.0  # rank 0: a collective that waits this long for a rank fails: the rank is lost
# the other ranks wait on rank 0's next step for as long as it idles (a gone rank 0 closes its
# connections, which fails them at once; they are its actors and end with it besides)
FOLLOWER_TIMEOUT_S = 30 * 24 * 3600.0


class TPGroup:
    """One rank's view of its group: the collectives the decoder and the pool use."""

    def __init__(self, rank: int, world: int, backend=None, device: str = "cpu"):
        self.rank, self.world, self._pg, self.device = rank, world, backend, torch.device(device)
        self._pools = 0  # rank 0: KV pools the other ranks were asked to make (kv_cache.py)

    @property
    def first(self) -> bool:
        return self.rank == 0

    def new_pool_id(self) -> int:
        self._pools += 1
        return self._pools

    def stop(self) -> None:
        """Rank 0: every other rank's follow returns (the model is let go)."""
        if self.world > 1 and self.first:
            self.send(("stop",))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank sums in the same order: the same bits everywhere)."""
        if self.world > 1:
            self._wait(self._pg.allreduce([tensor]), "all-reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor, side by side along the last dimension (rank order)."""
        if self.world == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self._wait(self._pg.allgather([parts], [tensor.contiguous()]), "all-gather")
        return torch.cat(parts, dim=-1)

    def send(self, message) -> None:
        """From rank 0: a Python value every other rank receives (``receive``), in order."""
        data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._broadcast(size)
        self._broadcast(data.to(self.device))

    def receive(self):
        """On a rank past 0: the next value rank 0 sent."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        return pickle.loads(data.cpu().numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._wait(self._pg.broadcast(tensor.to(self.device) if tensor.device != self.device else tensor, 0),
                   "broadcast")

    def _wait(self, work, what: str) -> None:
        """A collective, done; one that fails (a rank gone, or silent past the group's timeout) is
        RankLost: the group's ranks are apart from then on, and the worker exits for its group to
        start again (errors.exit_on_device_failure)."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise RankLost(f"rank {self.rank} of {self.world}: a tensor-parallel {what} failed ({exc})") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def connect(rank: int, world: int, host: str, port: int, device: str = "cpu",
            timeout_s: float = GROUP_TIMEOUT_S) -> TPGroup:
    """Join the group of ``world`` ranks whose rank 0 listens at host:port (every rank calls this;
    it returns once all have joined). gloo on a CPU, NCCL on a GPU."""
    from torch.distributed import TCPStore

    if world == 1:
        return TPGroup(0, 1, None, device)
    timeout = datetime.timedelta(seconds=timeout_s if rank == 0 else FOLLOWER_TIMEOUT_S)
    listener = None
    if rank == 0:  # the rendezvous listens on host alone (TCPStore's own server listens on every address)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
    store = TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                     master_listen_fd=None if listener is None else listener.fileno())
    if torch.device(device).type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout  # the watchdog's: a following rank idles as long as rank 0 does
        backend = ProcessGroupNCCL(store, rank, world, options)
    else:
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        # gloo's pairs listen on the rendezvous host's address (127.0.0.1 where the ranks are local),
        # not on whatever the machine's name resolves to (DESIGN.md, Placement)
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        backend = ProcessGroupGloo(store, rank, world, options)
    group = TPGroup(rank, world, backend, device)
    group._listener = listener  # its descriptor is the store's: kept open as long as the group
    return group


@dataclass(frozen=True)
class Shard:
    """A rank's place in a tensor-parallel model: what ``model.svip_tp`` holds."""

    group: TPGroup
    vocab: int  # the whole model's logits
    vocab_rows: int  # each rank's rows of the embedding and the LM head (the last one padded)

    @property
    def vocab_start(self) -> int:
        return self.group.rank * self.vocab_rows

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embedding of ids [tokens] from this rank's rows, summed over ranks: each id's from its rank."""
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_rows)
        rows = torch.nn.functional.embedding(local.clamp(0, self.vocab_rows - 1), weight)
        return self.group.all_reduce(rows * held[:, None].to(rows.dtype))

    def logits(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's logits [rows, vocab_rows], gathered into the whole vocabulary's [rows, vocab]."""
        return self.group.all_gather(local)[:, : self.vocab]


def check_degree(config, world: int) -> None:
    """A degree this model's shape divides (a one-line InvalidRequest names what does not)."""
    check_tp_degree(world)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("KV heads", kv_heads),
                        ("MLP columns (intermediate_size)", config.intermediate_size)):
        if count % world:
            raise InvalidRequest(f"a tensor parallel degree of {world} does not divide the model's {count} {what}")


def shard_config(config, world: int):
    """The config of one rank's shard: heads, KV heads, MLP columns and vocabulary rows split."""
    check_degree(config, world)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    narrow = config.__class__(**{**config.to_dict(), "num_attention_heads": config.num_attention_heads // world,
                                 "num_key_value_heads": kv_heads // world, "head_dim": head_dim,
                                 "intermediate_size": config.intermediate_size // world,
                                 "vocab_size": -(-config.vocab_size // world)})
    return narrow


def load_shard(path: str, group: TPGroup, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """This rank's shard of the model at ``path`` (a directory of safetensors files, or a hub id
    fetched into the hub cache: svip_common/hub.py), read a slice at a time; ``model.svip_tp`` set.
    Returns (model, the whole model's config)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from svip_common.hub import local_dir

    directory = local_dir(path, SHARD_FILES)
    try:
        config = AutoConfig.from_pretrained(directory).get_text_config(decoder=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path!r}: {exc}") from None
    narrow = shard_config(config, group.world)
    if not isinstance(dtype, torch.dtype):  # "auto": the checkpoint's own
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(narrow, dtype=dtype)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    slicer = _Slicer(config, group.rank, group.world, narrow.vocab_size)
    loaded = set()
    for file in _weight_files(directory):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    continue
                with torch.no_grad():
                    params[name].copy_(slicer.take(name, f.get_slice(name)).to(dtype))
                loaded.add(name)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{path!r}: no weights for {', '.join(missing[:3])} in its safetensors files")
    if tied:
        model.tie_weights()
    if (directory / "generation_config.json").is_file():  # its end-of-sequence ids, as a whole model's
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    base = model.model
    base.rotary_emb = type(base.rotary_emb)(config=narrow).to(device)  # its buffers, made again off meta
    model.svip_tp = Shard(group, config.vocab_size, narrow.vocab_size)
    return model.eval(), config


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(directory)!r} holds no safetensors files (tensor parallel reads slices of them)")
    return files


@dataclasses.dataclass
class _Slicer:
    """Which slice of each weight a rank holds (by the parameter's name, transformers' Llama names)."""

    config: object
    rank: int
    world: int
    vocab_rows: int

    def take(self, name: str, tensor_slice) -> torch.Tensor:
        c, r, n = self.config, self.rank, self.world
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        q_rows, kv_rows, mlp = c.num_attention_heads * head_dim // n, kv_heads * head_dim // n, c.intermediate_size // n
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return tensor_slice[r * q_rows : (r + 1) * q_rows]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return tensor_slice[r * kv_rows : (r + 1) * kv_rows]
        if name.endswith("o_proj.weight"):
            return tensor_slice[:, r * q_rows : (r + 1) * q_rows]
        if name.endswith(("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias")):
            return tensor_slice[r * mlp : (r + 1) * mlp]
        if name.endswith("down_proj.weight"):
            return tensor_slice[:, r * mlp : (r + 1) * mlp]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = tensor_slice[r * self.vocab_rows : (r + 1) * self.vocab_rows]
            if rows.shape[0] < self.vocab_rows:  # the last rank's rows, padded to the others'
                rows = torch.cat([rows, rows.new_zeros(self.vocab_rows - rows.shape[0], *rows.shape[1:])])
            return rows
        return tensor_slice[:]  # norms, biases of row-parallel layers: whole on every rank


def follow_as_rank(path: str, rank: int, world: int, host: str, port: int, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> None:
    """A rank past 0, to the end: join the group at host:port, load this rank's shard, then follow
    rank 0 (kv_cache.follow) until it says stop."""
    from svip_common.kv_cache import follow

    group = connect(rank, world, host, port, device)
    model, _ = load_shard(path, group, dtype, device)
    follow(model)


class LocalRanks:
    """The ranks past 0 of a tensor-parallel model, each a thread of this process (the in-process
    engine's; a cluster's are Ray actors, svip_runtime/ranks.py). ``group`` is rank 0's, once every
    rank has joined; a rank's failure stops its thread and fails rank 0's next collective."""

    def __init__(self, path: str, world: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        import threading

        port = free_port()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._follow, name=f"tp-rank-{rank}", daemon=True,
                                         args=(path, rank, world, port, dtype, _rank_device(device, rank)))
                        for rank in range(1, world)]
        for thread in self.threads:
            thread.start()
        self.group = connect(0, world, "127.0.0.1", port, _rank_device(device, 0))
        import atexit

        atexit.register(self.close)  # at the latest when the process exits

    def close(self) -> None:
        """The other ranks stop following and their threads end (before the process exits: a thread
        left inside a collective aborts the interpreter's exit); once."""
        if any(thread.is_alive() for thread in self.threads) and not self.errors:
            self.group.stop()
        for thread in self.threads:
            thread.join(GROUP_TIMEOUT_S)

    def _follow(self, *args) -> None:
        try:
            follow_as_rank(args[0], args[1], args[2], "127.0.0.1", *args[3:])
        except BaseException as exc:  # noqa: BLE001 - kept for whoever asks; rank 0's collective fails too
            self.errors.append(exc)


def _rank_device(device: str, rank: int) -> str:
    """Each local rank's device: its own GPU (cuda:rank), or the CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else device
