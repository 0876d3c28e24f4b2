"""What one deployment of the app serves and how it is placed: the `args` of the Serve config
(deploy/serve-config.yaml, the Helm chart's serveConfigV2) and of `svip serve`, checked up front
with errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from svip_assets import check_pair_models, pair_paths
from svip_common.auto_settings import AutoSettings
from svip_common.contracts import PolicyConfig
from svip_common.errors import InvalidRequest
from svip_common.hub import split_revision
from svip_common.knob import SETTINGS
from svip_common.knobs import carried_by, carrying, checked
from svip_common.pair_config import PairConfig, check_gpus, pair_options, worker_emulation
from svip_serve.auth import split_name

EMBEDDED_MODEL_NAME = "svip-pair"
REPLICA_CPUS = 0.5  # the replica only relays: asyncio, gRPC and tokenization
TARGET_BUNDLE, DRAFT_BUNDLE = 1, 2  # bundle 0 holds the replica


@carrying(SETTINGS)
class ServeSettings:
    """The app's arguments: every knob svip_common/knobs.py declares for the Serve app (SETTINGS),
    each with its one default there."""

    @classmethod
    def from_args(cls, args: dict | None) -> ServeSettings:
        args = dict(args or {})
        settings = cls(**checked(args, SETTINGS, noun="app argument"))
        settings.validate()
        return settings

    def validate(self) -> None:
        """Each knob alone (svip_common/knob.py), then the rules between them."""
        for k in carried_by(SETTINGS):
            k.check(getattr(self, k.name))
        if self.device not in ("cpu", "cuda"):
            raise InvalidRequest(f"device must be 'cpu' or 'cuda' (a pipeline's workers take their GPUs from Ray), "
                                 f"got {self.device!r}")
        check_pair_models(self.target, self.draft, self.draft_kind)
        check_gpus(self.target_tp, self.target_gpus)
        check_gpus(self.draft_tp, self.draft_gpus, "draft")
        self.policy_defaults().validate(self.draft_length_cap)
        self.auto().check()
        if self.emulate is not None:
            worker_emulation(self.emulate, self.draft != "none")
        if not all(_is_key_digest(h) for h in self.api_key_sha256):
            raise InvalidRequest(
                "api_key_sha256 must be a list of SHA-256 digests (64 hex digits, optionally "
                "`name:` before them), not the keys"
            )

    def pair_config(self) -> PairConfig:
        """A replica's pair and its workers (svip_common/pair_config.py): every pair knob as set here,
        packed on the replica's node (its placement group is STRICT_PACK: the workers talk over the
        node's loopback)."""
        target, draft = self.model_paths()
        return PairConfig.of(target, draft, packed=True, **pair_options(dataclasses.asdict(self)))

    def auto(self) -> AutoSettings:
        """The `auto` policy's settings, checked (svip_common/acceptance.py)."""
        return AutoSettings(learn=self.auto_learn, cost=self.auto_cost, window=self.auto_window).check()

    def policy_defaults(self) -> PolicyConfig:
        """What a request that names no policy knobs gets; within the cap."""
        base = PolicyConfig()
        return PolicyConfig(
            name=self.policy,
            threshold=self.threshold,
            tree=self.tree,
            draft_length=min(base.draft_length, self.draft_length_cap),
            max_draft_length=min(base.max_draft_length, self.draft_length_cap),
        )

    def model_paths(self) -> tuple[str, str | None]:
        """(target, draft or None) as directories or hub ids."""
        return pair_paths(self.target, self.draft, self.draft_kind)

    @property
    def served_name(self) -> str:
        """The id clients pass as `model`: never a filesystem path (a target directory is known by
        its last component; a hub id as it is)."""
        if self.model_name:
            return self.model_name
        if self.target is None:
            return EMBEDDED_MODEL_NAME
        if Path(self.target).expanduser().exists():
            return Path(self.target).name
        return split_revision(self.target)[0]  # a hub id as it is, without a pinned revision

    @property
    def gpus(self) -> bool:
        return self.device == "cuda"

    def bundles(self) -> list[dict[str, float]]:
        """The replica's placement group: the replica itself, then the target, then the draft,
        packed onto one node (the workers listen on that node's loopback)."""
        target, draft = {"CPU": self.worker_cpus * self.target_tp}, {"CPU": self.worker_cpus * self.draft_tp}
        if self.gpus:  # a GPU each rank of a tensor-parallel model
            target_gpus = self.target_gpus if self.target_tp == 1 else self.target_tp
            draft_gpus = self.draft_gpus if self.draft_tp == 1 else self.draft_tp
            target["GPU"], draft["GPU"] = float(target_gpus), float(draft_gpus)
        bundles = [{"CPU": REPLICA_CPUS}, target]
        return bundles + [draft] if self.draft != "none" else bundles


def _is_key_digest(value) -> bool:
    """A SHA-256 hex digest, or `name:` and one."""
    if not isinstance(value, str):
        return False
    _, hexdigest = split_name(value)
    return len(hexdigest) == 64 and all(c in "0123456789abcdef" for c in hexdigest)

