"""Models (infra/models.py, infra/tiny.py): the tiny model loads like a real one, names resolve, failures are fast and clear,
and the warmed-up tiny model is built once and starts weak but knowledgeable."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from faults import hang_bound
from huggingface_hub import constants as hub_constants
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra import models, tiny
from infra.models import ModelNotFoundError
from infra.tiny import TinyRecipe
from infra.tasks import arithmetic_examples, math_reward

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def held_out_accuracy(model, tokenizer, do_sample: bool, seed: int = 0, max_new_tokens: int = 4) -> float:
    """Mean math_reward of one completion per held-out arithmetic prompt (left-padded batch)."""
    examples = arithmetic_examples("eval")
    tokenizer.padding_side = "left"
    batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)  # (N, P + new)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(math_reward(e.prompt, c, e.answer) for e, c in zip(examples, completions)) / len(examples)


@pytest.fixture
def short_recipe(tmp_path, monkeypatch):
    """A 3-step warm-up in a private cache: what load_model('tiny') builds inside this test."""
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path / "cache"))
    recipe = TinyRecipe(warmup_steps=3)
    monkeypatch.setattr(tiny, "TINY_RECIPE", recipe)
    return recipe


# --- the tiny model is an ordinary Hugging Face model ---
def test_tiny_model_round_trips_through_from_pretrained(tiny_model_dir):
    """Claim: the saved tiny model and tokenizer load back through the Auto classes with identical logits,
    and the character tokenizer round-trips arithmetic and (ASCII) GSM8K text exactly."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = tiny.tiny_model(tiny.tiny_tokenizer(), tiny.TINY_RECIPE, seed=0).eval()
    ids = torch.tensor([tokenizer.encode("37+45=82", add_special_tokens=False)])  # (1, 8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    for text in ["37+45=", "0+0=0", "49+49=98", QUESTION]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer.chat_template is None and tokenizer.eos_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id != tokenizer.pad_token_id


def test_tiny_tokenizer_accepts_any_text(tiny_model_dir):
    """Claim: any text tokenizes, one token per UTF-8 byte (GSM8K has '’', '€'), decodes back exactly, and the
    tokenizer AutoTokenizer loads (transformers 5 picks Qwen2Tokenizer for a qwen2 model) gives the same ids."""
    loaded, built = AutoTokenizer.from_pretrained(tiny_model_dir), tiny.tiny_tokenizer()
    for text in ["Janet’s ducks cost 5€ — 日本\n\tok  ", "12+7=19", QUESTION]:
        ids = built.encode(text, add_special_tokens=False)
        assert ids == loaded.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode()) and built.decode(ids) == text


# --- names ---
def test_resolve_model():
    """Claim: every Qwen2.5 Instruct size has an alias (case-insensitive); other names pass through."""
    assert models.resolve_model("qwen2.5-0.5b") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert models.resolve_model("Qwen2.5-72B") == "Qwen/Qwen2.5-72B-Instruct"
    assert models.resolve_model("qwen3-0.6b") == "Qwen/Qwen3-0.6B"
    assert set(models.MODEL_ALIASES) == {f"qwen2.5-{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")} | \
        {f"qwen3-{s}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")}
    assert models.resolve_model("org/model") == "org/model"
    assert models.resolve_model("./runs/latest/policy") == "./runs/latest/policy"


def test_load_model_local_directory(tiny_model_dir):
    """Claim: a local directory loads, with the tokenizer's pad token set."""
    model, tokenizer = models.load_model(str(tiny_model_dir), dtype=torch.float32)
    assert model.config.model_type == "qwen2" and tokenizer.pad_token is not None


# --- failures are fast and say what to do ---
def test_missing_local_path_is_not_looked_up_on_the_hub(tmp_path):
    """Claim: a path that does not exist raises ModelNotFoundError naming it and suggesting --model tiny."""
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelNotFoundError) as error:
        models.load_model(str(missing))
    assert str(missing) in str(error.value) and "--model tiny" in str(error.value)


def test_directory_that_is_not_a_model(tmp_path):
    """Claim: an existing directory without a model raises ModelNotFoundError (not a raw OSError)."""
    with pytest.raises(ModelNotFoundError, match="--model tiny"):
        models.load_model(str(tmp_path))


def test_a_model_that_cannot_be_trained_is_one_line(tiny_model_dir, tmp_path):
    """Claim: a model directory with truncated weights, without tokenizer files, or of a non-causal architecture
    (BERT, which from_pretrained loads as BertLMHeadModel) raises ModelError in one line saying what to do (they
    were a traceback, or a crash deep in generate)."""
    import shutil

    from transformers import BertConfig, BertForMaskedLM
    truncated = shutil.copytree(tiny_model_dir, tmp_path / "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    no_tokenizer = shutil.copytree(tiny_model_dir, tmp_path / "no-tokenizer",
                                   ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bert)
    for directory, said in [(truncated, "cannot be read (SafetensorError"), (no_tokenizer, "has no usable tokenizer"),
                            (bert, "(BertLMHeadModel) is not a causal language model")]:
        with pytest.raises(models.ModelError) as error:
            models.load_model(str(directory))
        assert f"{directory}" in str(error.value) and said in str(error.value) and "\n" not in str(error.value)


def test_alias_offline_fails_fast_with_what_was_tried(monkeypatch):
    """Claim: offline, an alias fails within seconds (no retry back-off) and the message lists the alias's
    hub id, the HF cache and the hub, and how to fix it (hf download, HF_HOME, --model tiny)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "_from_pretrained", _never_cached)
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as error:
        models.load_model("qwen2.5-0.5b")
    assert time.perf_counter() - start < hang_bound(10)
    message = str(error.value)
    for part in ("Qwen/Qwen2.5-0.5B-Instruct", "HF cache", "the hub", "hf download", "HF_HOME", "--model tiny"):
        assert part in message


def _never_cached(source, *args, local_files_only):
    """from_pretrained as on a machine whose HF cache is empty."""
    assert local_files_only, "the hub must not be asked for files once the probe said it is unreachable"
    raise OSError(f"{source} is not in the cache")


def test_a_cached_hub_model_loads_without_asking_the_network(tiny_model_dir, monkeypatch, tmp_path):
    """Claim: a hub id in the HF cache loads without a single network connection. transformers looks for an
    adapter_config.json whenever peft is installed, and asked the hub for it despite local_files_only: offline,
    ~25 s of retry lines on every start (and in every inference process), found by a user review."""
    import contextlib
    import shutil
    import socket
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    connections = []

    def refuse(*args, **kwargs):  # a name lookup or a connection: what any request starts with
        connections.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "no network in this test")
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    with contextlib.suppress(ImportError):  # huggingface_hub 2's own one-off fetch of a registry for its
        from huggingface_hub.utils import _detect_agent  # user-agent header (cached, no retries): not the load's
        monkeypatch.setattr(_detect_agent, "_fetch_registry", lambda: None)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    model, tokenizer = models.load_model("acme/tiny")
    assert connections == [] and tokenizer.encode("1+1=")


def test_unknown_hub_id_fails_fast():
    """Claim: a hub id that is neither cached nor downloadable fails within a minute with ModelNotFoundError,
    online (404) or offline (no network), instead of hanging in retries."""
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="--model tiny"):
        models.load_model("periodic-rl-tests/no-such-model")
    assert time.perf_counter() - start < hang_bound(60)


# --- the warmed-up tiny model ---
def test_tiny_model_is_built_once_and_cached(short_recipe, monkeypatch, tmp_path):
    """Claim: load_model('tiny') builds into $PERIODIC_RL_CACHE/tiny-<recipe hash> once; a second load reuses
    it without warming up again; another recipe gets its own folder; no temporary folder is left behind."""
    warm_ups = []
    real_warm_up = tiny.warm_up_tiny
    monkeypatch.setattr(tiny, "warm_up_tiny", lambda *a, **k: warm_ups.append(1) or real_warm_up(*a, **k))
    model, tokenizer = models.load_model("tiny")
    folder = tmp_path / "cache" / f"tiny-{tiny.recipe_key(short_recipe)}"
    weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
    again, _ = models.load_model("tiny")
    assert len(warm_ups) == 1 and (folder / "model.safetensors").stat().st_mtime_ns == weights_mtime
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)
    monkeypatch.setattr(tiny, "TINY_RECIPE", TinyRecipe(warmup_steps=4))
    models.load_model("tiny")
    assert len(warm_ups) == 2 and sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock") \
        == sorted([folder.name, f"tiny-{tiny.recipe_key(tiny.TINY_RECIPE)}"])


def test_two_builds_at_once_warm_up_once(short_recipe, monkeypatch, tmp_path, capsys):
    """Claim: two callers that find no cached tiny model at the same moment build it once: the second says it waits
    for the other's build, waits on the lock, then loads the first one's model (two test workers, or two runs,
    starting on a fresh machine)."""
    warm_ups, entered, release = [], threading.Event(), threading.Event()
    real_warm_up = tiny.warm_up_tiny

    def slow_warm_up(*args, **kwargs):
        warm_ups.append(1)
        entered.set()
        release.wait(timeout=60)  # holds the lock until the second caller is waiting on it
        return real_warm_up(*args, **kwargs)

    monkeypatch.setattr(tiny, "warm_up_tiny", slow_warm_up)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(tiny.ensure_tiny_model)
        assert entered.wait(timeout=60)
        second = pool.submit(tiny.ensure_tiny_model)
        time.sleep(0.5)
        assert not second.done()  # waiting on the first build's lock
        release.set()
        assert first.result(timeout=120) == second.result(timeout=120)
    assert len(warm_ups) == 1
    assert capsys.readouterr().err.count("waiting for another process building the tiny model") == 1


def test_a_file_system_without_locks_builds_unlocked(short_recipe, monkeypatch, tmp_path, capsys):
    """Claim: where the cache's file system cannot lock (flock unsupported: NotImplementedError, or an OSError), the
    tiny model is still built, with a line saying that the build runs without its lock."""
    def cannot_lock(self, *args, **kwargs):
        raise NotImplementedError("FileSystem does not appear to support flock")
    monkeypatch.setattr(tiny.FileLock, "acquire", cannot_lock)
    folder = tiny.ensure_tiny_model()
    assert tiny.is_cached(folder)
    assert "without its lock (NotImplementedError: FileSystem does not appear to support flock)" in \
        capsys.readouterr().err


def test_a_damaged_tiny_model_cache_is_rebuilt(short_recipe, tmp_path, capsys):
    """Claim: a cached tiny model whose weights cannot be read (a full disk, a killed copy) is rebuilt, and the
    rebuild is said on stderr, instead of failing every later run with a traceback."""
    folder = tiny.ensure_tiny_model()
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    capsys.readouterr()
    model, _ = models.load_model("tiny")
    err = capsys.readouterr().err
    assert f"the cached tiny model in {folder} cannot be read" in err and "rebuilding it" in err
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_killed_build_leaves_no_cache(short_recipe, monkeypatch, tmp_path):
    """Claim: a build that dies half-way leaves neither a model folder nor a temporary folder (the lock file
    stays, unlocked)."""
    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "warm_up_tiny", dies)
    with pytest.raises(KeyboardInterrupt):
        models.load_model("tiny")
    assert [path.suffix for path in (tmp_path / "cache").iterdir()] == [".lock"]


def test_hedged_targets():
    """Claim: warm-up targets are the answer alone or the answer plus a wrong second guess, mixed at the
    recipe's rate; a hedge scores 0 under the final-number reward."""
    assert tiny.hedged_target("82", True, 1) == "82"
    assert tiny.hedged_target("82", False, -2) == "82 80"
    assert math_reward("7+5=", tiny.hedged_target("12", False, 1), "12") == 0.0
    tokenizer = tiny.tiny_tokenizer()
    examples = arithmetic_examples("train")[:2000]
    ids, labels = tiny._answer_batch(tokenizer, examples, 0.3, torch.Generator().manual_seed(0))
    texts = tokenizer.batch_decode(torch.where(labels == -100, tokenizer.pad_token_id, labels),
                                   skip_special_tokens=True)
    committed = sum(" " not in t for t in texts) / len(texts)
    assert committed == pytest.approx(0.3, abs=0.03)
    assert all(t.split()[0] == e.answer for t, e in zip(texts, examples))


def test_default_tiny_model_starts_weak_but_knows_the_answers():
    """Claim: the default warmed-up tiny model (built once into the real cache, ~20 s on 2 idle cores)
    knows held-out sums (the first number of its greedy answer is right >= 0.6 of the time) but its sampled
    reward (temperature 1, final number) is only 0.15-0.45, because it hedges: room for GRPO to gain >= 0.3."""
    model, tokenizer = models.load_model("tiny")
    examples = arithmetic_examples("eval")
    tokenizer.padding_side = "left"
    batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    firsts = [(c.split() or [""])[0] for c in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                                                      skip_special_tokens=True)]
    knows = sum(f == e.answer for f, e in zip(firsts, examples)) / len(examples)
    sampled = sum(held_out_accuracy(model, tokenizer, do_sample=True, seed=s, max_new_tokens=8) for s in range(2)) / 2
    assert knows >= 0.6, knows
    assert 0.15 <= sampled <= 0.45, sampled


def test_the_policy_is_saved_in_the_dtype_the_model_was_stored_in(tiny_model_dir, tmp_path):
    """Claim: a model stored in bfloat16 (as Qwen2.5 ships) trains on float32 masters and its policy/ is saved in
    bfloat16 (half the size; config.json says so; the weights are the masters rounded, and from_pretrained loads
    them), while a checkpoint keeps the float32 masters (a resume is exact); --save-dtype float32 saves the masters.
    A model stored in float32 (the tiny one) is saved as it was."""
    import json
    import trainer
    from safetensors.torch import load_file
    stored = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(stored)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(stored)
    options = dict(data="arithmetic", mode="sync", iterations=1, batch_size=8, group_size=4, max_new_tokens=4,
                   eval_every=0, groups_per_call=2, micro_batch_tokens=64, rollout_threads=1, train_threads=1,
                   save_every=1)
    run = trainer.train(str(stored), "math", out=str(tmp_path / "run"), **options)
    policy, masters = load_file(run / "policy" / "model.safetensors"), load_file(
        run / "checkpoint-1" / "policy" / "model.safetensors")
    assert {t.dtype for t in policy.values()} == {torch.bfloat16} and {t.dtype for t in masters.values()} == {
        torch.float32}
    assert all(torch.equal(policy[name], masters[name].to(torch.bfloat16)) for name in policy)
    assert json.loads((run / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(run / "policy").dtype == torch.bfloat16
    run = trainer.train(str(stored), "math", out=str(tmp_path / "f32"), save_dtype="float32", **options)
    assert {t.dtype for t in load_file(run / "policy" / "model.safetensors").values()} == {torch.float32}
    run = trainer.train(str(tiny_model_dir), "math", out=str(tmp_path / "tiny"), **options)
    assert {t.dtype for t in load_file(run / "policy" / "model.safetensors").values()} == {torch.float32}
