"""The length policies the protocol's tests run every mode under: one of each kind, at settings
that draft blocks of several lengths on the tests' tiny pair (and `none`: the target alone)."""

from __future__ import annotations

from svip_common.contracts import PolicyConfig

POLICIES = {
    "svip": PolicyConfig(name="svip", threshold=0.6),
    "constant": PolicyConfig(name="constant", draft_length=4),
    "heuristic": PolicyConfig(name="heuristic", draft_length=3),
    "confidence": PolicyConfig(name="confidence", confidence=0.2),
    "auto": PolicyConfig(name="auto"),
    "none": PolicyConfig(name="none"),
}
# each a token tree (svip_common/trees.py): the depth by the policy, the width by CaPE or priced, and
# deep trees' nodes grown below the siblings (priced too)
TREE_POLICIES = {
    "svip-cape": PolicyConfig(name="svip", threshold=0.6, tree="cape"),
    "constant-cape": PolicyConfig(name="constant", draft_length=4, tree="cape"),
    "svip-auto": PolicyConfig(name="svip", threshold=0.6, tree="auto"),
    "auto-cape": PolicyConfig(name="auto", tree="cape"),
    "svip-deep": PolicyConfig(name="svip", threshold=0.6, tree="deep"),
    "constant-deep-auto": PolicyConfig(name="constant", draft_length=4, tree="deep-auto"),
}
