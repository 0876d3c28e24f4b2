"""Hostile and broken input at the pure layers: request bodies that used to give 500s, caps on the
knobs a request sets, temperatures too small to divide by, padding columns, an admission place
lost to a cancelled waiter, detokenization that must stay linear, API keys."""

from __future__ import annotations

import asyncio

import pytest
import torch

from svip_common.contracts import DRAFT_LENGTH_CAP, GenerationRequest, Limits, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.sampling import mask_padding, warp_probs
from svip_serve.admission import Admission
from svip_serve.auth import ApiKeys, digest, named_digest
from svip_serve.protocol import ApiError, parse_json
from svip_serve.settings import ServeSettings
from svip_serve.text import IncrementalDetokenizer


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "number in the request body is too long"),
    (b'{"prompt": "a\\ud800b"}', "prompt is not valid Unicode"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content is not valid Unicode"),
    (b'{"stop": ["ok", "\\ud83d"]}', "stop[1] is not valid Unicode"),
    (b'{"\\ud800": 1}', "a key is not valid Unicode"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_bodies_that_gave_500s_are_400s(raw, words):
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and words in err.value.message


def test_a_body_without_a_surrogate_escape_is_not_walked(monkeypatch):
    """Walking every value of a 4 MiB body on the event loop took ~0.9 s (review M6): a body
    with no \\uD800-\\uDFFF escape cannot hold a lone surrogate, so it is not walked at all."""
    import svip_serve.protocol as protocol

    def walked(_):
        raise AssertionError("walked")

    monkeypatch.setattr(protocol, "_lone_surrogate", walked)
    assert parse_json(b'{"prompt": [' + b"1, " * 200_000 + b'1], "stop": ["\\u00e9"]}')["stop"] == ["\u00e9"]
    with pytest.raises(AssertionError, match="walked"):
        parse_json(b'{"prompt": "\\ud83d\\udc0d"}')


def test_a_paired_surrogate_is_fine():
    assert parse_json(b'{"prompt": "\\ud83d\\udc0d"}') == {"prompt": "\U0001f40d"}


def test_request_caps_and_int32_ranges():
    limits = Limits(tokens=100, positions=None)
    ok = GenerationRequest((1, 2), 5)
    ok.validate(limits)
    with pytest.raises(InvalidRequest, match=r"max_new_tokens must be in \[1, 2\^31\)"):
        GenerationRequest((1, 2), 2**31).validate(limits)
    with pytest.raises(InvalidRequest, match=r"top_k must be in \[0, 2\^31\)"):
        GenerationRequest((1, 2), 5, SamplingParams(1.0, top_k=2**31)).validate(limits)
    with pytest.raises(InvalidRequest, match=rf"max draft length must be in \[1, {DRAFT_LENGTH_CAP}\]"):
        GenerationRequest((1, 2), 5, policy=PolicyConfig(max_draft_length=10**6)).validate(limits)
    small = Limits(tokens=100, positions=None, max_draft_length=8)
    with pytest.raises(InvalidRequest, match=r"draft length must be in \[1, 8\], got 9"):
        GenerationRequest((1, 2), 5, policy=PolicyConfig(name="constant", draft_length=9, max_draft_length=8)).validate(
            small
        )
    with pytest.raises(InvalidRequest, match="prompt token id 100 is outside the vocabulary"):
        GenerationRequest((1, 100), 5).validate(limits)


def test_a_deployment_cap_below_the_defaults_lowers_the_defaults():
    settings = ServeSettings.from_args({"draft_length_cap": 4})
    defaults = settings.policy_defaults()
    assert defaults.max_draft_length == 4 and defaults.draft_length == 4
    defaults.validate(4)
    with pytest.raises(InvalidRequest, match="draft_length_cap"):
        ServeSettings.from_args({"draft_length_cap": 0})
    with pytest.raises(InvalidRequest, match="SHA-256 digests"):
        ServeSettings.from_args({"api_key_sha256": ["my-secret-key"]})


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 9e-6])
def test_temperatures_below_1e_5_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.greedy
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all() and int(probs.argmax()) == 1
    assert not SamplingParams(temperature=1e-5).greedy


def test_padding_columns_are_never_chosen():
    logits = torch.tensor([[0.0, 1.0, 50.0, 60.0]])  # columns 2 and 3: a checkpoint's padding
    masked = mask_padding(logits.clone(), limit=2)
    assert int(masked.argmax()) == 1
    probs = warp_probs(masked, SamplingParams(temperature=1.0))
    assert probs[0, 2:].sum() == 0 and torch.isclose(probs[0, :2].sum(), torch.tensor(1.0))
    unchanged = torch.tensor([[0.0, 1.0]])
    assert torch.equal(mask_padding(unchanged.clone(), limit=5), unchanged)


def test_a_waiter_cancelled_before_its_slot_gives_its_place_back():
    """A non-streaming request cancelled while it waits for admission (its client left) used to
    keep its place for ever: after max_waiting such cancels every request got 429."""

    async def scenario():
        adm = Admission(max_in_flight=1, max_waiting=2)
        holder = adm.reserve()
        await holder.__aenter__()
        for _ in range(10):  # far more than max_waiting
            slot = adm.reserve()
            waiter = asyncio.ensure_future(slot.__aenter__())
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert (adm.running, adm.waiting) == (1, 0)
        holder.release()
        again = adm.reserve()
        async with again:
            assert (adm.running, adm.waiting) == (1, 0)
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(scenario())


class CountingTokenizer:
    """A tokenizer that counts how many ids it was asked to decode (the detokenizer's work)."""

    def __init__(self, tokenizer):
        self.inner, self.decoded = tokenizer, 0
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from svip_assets import default_pair

    return AutoTokenizer.from_pretrained(default_pair()[0])


def _work(tokenizer, ids) -> tuple[int, str]:
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.push(t) for t in ids)
    return counting.decoded, text


def test_detokenization_stays_linear_when_tokens_decode_to_nothing(tokenizer):
    """2,000 EOS tokens (ignore_eos) used to cost O(n^2): each decode covered every id since the
    last visible character."""
    eos = tokenizer.eos_token_id
    small, _ = _work(tokenizer, [eos] * 500)
    large, text = _work(tokenizer, [eos] * 2000)
    assert text == ""
    assert large <= 5 * small + 100  # linear: 4x the ids, ~4x the work (quadratic: 16x)


def test_detokenization_stays_linear_on_bytes_that_never_form_a_character(tokenizer):
    vocab = tokenizer.get_vocab()
    lone = [vocab[_byte_level(b)] for b in (0x86, 0x87)]  # UTF-8 continuation bytes, never a character
    assert tokenizer.decode(lone) == "\ufffd\ufffd"
    small, _ = _work(tokenizer, lone * 250)
    large, text = _work(tokenizer, lone * 1000)
    assert large <= 5 * small + 100
    assert text.count("\ufffd") > 0  # released as replacement characters, not held for ever


def _byte_level(byte: int) -> str:
    """The character GPT-2's byte-level alphabet uses for a byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def test_detokenization_with_special_tokens_inside_text_equals_full_decode(tokenizer):
    ids = tokenizer("def f(x):\n    return x  # naïve 🐍")["input_ids"]
    eos = tokenizer.eos_token_id
    mixed = [t for i in ids for t in ((i, eos) if i % 3 == 0 else (i,))]
    _, text = _work(tokenizer, mixed)
    assert text == tokenizer.decode(mixed, skip_special_tokens=True)


K1, K2, K3 = ("k1-" + "a" * 32, "k2-" + "b" * 32, "k3-" + "c" * 32)


def test_api_keys():
    keys = ApiKeys((digest(K1),), environ={"SVIP_API_KEY": f"{K2}, ops:{K3}"})
    assert keys.required
    for header, key_id in (
        (f"Bearer {K1}", f"key-{digest(K1)[:12]}"),
        (f"bearer {K2}", f"key-{digest(K2)[:12]}"),
        (f"Bearer  {K3} ", "ops"),
    ):
        assert keys.check(header) == key_id
    for header, words in (
        (None, "no API key given"),
        (K1, "no API key given"),
        ("Bearer", "no API key given"),
        ("Bearer k4", "incorrect API key"),
        (f"Basic {K1}", "no API key given"),
        (f"Bearer ops:{K3}", "incorrect API key"),
    ):
        with pytest.raises(ApiError) as err:
            keys.check(header)
        assert err.value.status == 401 and words in err.value.message
        assert (
            err.value.body()["error"]["code"] == "invalid_api_key" and err.value.headers["WWW-Authenticate"] == "Bearer"
        )
    open_api = ApiKeys((), environ={})
    assert not open_api.required
    assert open_api.check(None) is None
    assert ApiKeys((f"team-a:{digest(K1)}",), environ={}).check(f"Bearer {K1}") == "team-a"


def test_short_api_keys_are_refused():
    with pytest.raises(InvalidRequest, match="key 1 in \\$SVIP_API_KEY is 5 characters; keys must be at least 32"):
        ApiKeys((), environ={"SVIP_API_KEY": "short"})
    with pytest.raises(InvalidRequest, match="at least 32"):
        named_digest("name:" + "x" * 31)
    assert named_digest("name:" + "x" * 32) == "name:" + digest("x" * 32)


def test_admission_lets_small_requests_pass_a_head_that_does_not_fit():
    """Two requests that each need most of the KV room run one after the other; a small one
    behind them fits beside the first and runs at once; places and room come back on release."""

    async def scenario():
        adm = Admission(max_in_flight=8, max_waiting=8, kv_tokens=1000)
        big1, big2, small = adm.reserve(700), adm.reserve(600), adm.reserve(100)
        await big1.admitted()
        assert (adm.running, adm.waiting, adm.kv_used) == (2, 1, 800)
        await small.admitted()  # it did not wait behind big2
        second = asyncio.ensure_future(big2.admitted())
        await asyncio.sleep(0)
        assert not second.done()  # 600 does not fit yet
        big1.release()
        await second
        assert (adm.running, adm.waiting, adm.kv_used) == (2, 0, 700)
        big2.release()
        small.release()
        assert (adm.running, adm.waiting, adm.kv_used) == (0, 0, 0)

    asyncio.run(scenario())


def test_a_waiter_past_the_deadline_gets_429_and_its_place_back():
    async def scenario():
        adm = Admission(max_in_flight=1, max_waiting=1, max_wait_s=0.01)
        holder = await adm.reserve().admitted()  # never released while the waiter waits
        waiter = adm.reserve()
        with pytest.raises(ApiError) as err:
            await waiter.admitted()
        assert err.value.status == 429 and "waited 0.01 s" in err.value.message
        assert (adm.running, adm.waiting) == (1, 0)
        holder.release()
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_key_past_its_share_is_refused_and_others_are_not():
    """Counted from the key's check (enter), before the body is parsed: a key's third request is a
    429 before it costs the replica any parsing or tokenizing (review M6)."""
    async def scenario():
        adm = Admission(max_in_flight=1, max_waiting=4, max_per_key=2)
        first, second = adm.enter("bob"), adm.enter("bob")
        with pytest.raises(ApiError) as err:
            adm.enter("bob")
        assert err.value.status == 429 and "API key 'bob' already has 2 requests" in err.value.message
        first_slot = adm.reserve(ticket=first)
        second.release()  # its body failed to parse: its place goes back
        second_slot = adm.reserve(ticket=adm.enter("bob"))
        alice = adm.reserve(ticket=adm.enter("alice"))
        assert (adm.running, adm.waiting, dict(adm.per_key)) == (1, 2, {"bob": 2, "alice": 1})
        first_slot.release()
        third = adm.reserve(ticket=adm.enter("bob"))  # a place of bob's came back with its slot
        for slot in (second_slot, alice, third):
            slot.release()
        assert (adm.running, adm.waiting, dict(adm.per_key), dict(adm.kv_per_key)) == (0, 0, {}, {})

    asyncio.run(scenario())


def test_a_keys_kv_tokens_in_flight_are_bounded_and_others_are_not():
    """A key's requests hold at most max_kv_per_key KV tokens, running or waiting: past it a 429,
    a request that alone needs more a 400 naming max_tokens; another key is served meanwhile."""
    async def scenario():
        adm = Admission(max_in_flight=8, max_waiting=8, kv_tokens=10_000, max_kv_per_key=1000)
        big = adm.reserve(700, adm.enter("bob"))
        with pytest.raises(ApiError) as err:
            adm.reserve(400, adm.enter("bob"))
        assert err.value.status == 429 and "already holds 700 KV tokens" in err.value.message
        assert dict(adm.per_key) == {"bob": 2}  # the refused one's ticket is the server's to release
        with pytest.raises(ApiError) as err:
            adm.reserve(1001, adm.enter("alice"))
        assert err.value.status == 400 and err.value.param == "max_tokens"
        alice = adm.reserve(900, adm.enter("carol"))
        small = adm.reserve(300, adm.enter("bob"))
        assert dict(adm.kv_per_key) == {"bob": 1000, "carol": 900}
        for slot in (big, alice, small):
            slot.release()
        assert dict(adm.kv_per_key) == {}

    asyncio.run(scenario())
