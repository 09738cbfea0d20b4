"""Sizes from measurements: generate calls, micro-batch and CPU thread split, chosen per run.

The paper's pipeline is "demand-driven": each side gets what its measured work needs. Three sizes
decide how well the two sides overlap, and all depend on the model, the task and the machine:
how many `generate` calls sample an iteration (more calls: the trainer starts sooner, but every
call pays generate's fixed cost and its own longest response), how many tokens the trainer waits
for before a forward/backward (small: it starts sooner; big: fewer, more efficient passes), and,
on CPU, how the cores split between the inference and the training process. `probe` measures,
`predict_seconds` models an iteration from the measurements, `choose` picks.

The probe (before iteration 0; it changes nothing: its own RNG state, no optimizer step,
gradients dropped) samples iteration 0 for every call size it may choose, k = the whole iteration,
half of it, a quarter, ..., one prompt, as the inference side would (calls of k prompts one after
the other, seeded alike), recording when each group stops, in PASSES passes (biggest calls first,
then smallest first) of which each size keeps its fastest (`fastest`: noise on a shared machine only
adds time); each finished group is handed over as the sampler hands it over, inside `generate` (decoded,
its advantages, a ScoredGroup message pickled for the queue in async mode: `hand_over_work`), the reward call
aside. And it times the learner's own forward/backward (`learner.forward_backward`: the tri-model, the
GRPO loss, its backward) of one group and of all groups:

    arrivals_k = [(t_g, g)]   when group g was ready with calls of k prompts (streaming by completion)
    T_train(n) = d + c·n      a forward/backward of n tokens (rows of prompt + response, padded to the
                              micro-batch's longest: G·groups·max(P + R_max))

An iteration with n calls (k = ceil(prompts/n)) is then simulated on the measured arrivals: the
trainer applies the learner's rule (train the waiting groups once they reach the micro-batch's
tokens or their call has ended), d + c·tokens per micro-batch, never before the groups arrived.
The predicted iteration time is when the trainer finishes; the fewest calls, then the biggest
micro-batch, within 5% of the fastest win (sync mode, which samples then trains: the fewest calls
within 5% of the least generation). On CPU, async mode then splits the cores in proportion
to the two sides' measured demand, T_gen : T_train (at least one core each), and the micro-batches
trained once the last group is in are costed at all cores (the trainer takes them then:
launch.setup.train_threads_after_sampling); unless the second probe, at all cores, predicts that sampling then
training (sync's schedule, in one process: launch.setup.async_runs_as_sync) is faster. The probe costs about
PASSES iterations' generation per call size (five sizes for 16 prompts) and PASSES iterations' training; the
`probe:` line prints its seconds.
(A first version modelled a call of k prompts as its longest response x a per-step cost measured
on one call of k prompts; it was optimistic about many small calls, whose per-step cost depends on
how long their responses run: four calls predicted 1.0-1.1 s per iteration ran 1.4-1.7 s on the
chain task. Measuring each candidate's generation whole removes that guess.)

Deliberate departures:
1. Probed on CPU only. On an accelerator a decode step costs about the same for 8 rows as for
   512 (memory-bound), so one call per iteration is the rule (config.GENERATE_CALLS), and the
   trainer's float32 policy on the training device would time the wrong sampler anyway. There the
   micro-batch is lowered to what the device's memory holds instead (launch/memory.py).
2. With the `generate` fallback (--engine hf) the sizes change the rollouts (which prompts share a call, hence
   its random stream; engine.py's draws do not depend on them), and a rerun on a busier machine may choose
   differently. The chosen sizes are printed as flags; passing them fixes them, and a size that is given is
   never probed.
3. Under torchrun, trainer rank 0 alone probes, for one rank's share of the host's cores, and every rank
   takes its sizes (`choose_for_ranks`): the ranks must agree, and M probes at once would time each other.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from infra import distributed
from infra.hf_generate import sampling_config
from infra.options import GENERATE_CALLS, MICRO_BATCH_TOKENS, available_cores, fits_memory
from infra.tasks import run_prompt_ids
from learner import forward_backward, micro_batch_size
from rollout import iteration_prompts, sample_prompts, stop_token_ids

AS_FAST = 1.05  # fewer calls (then bigger micro-batches) win unless the others are predicted > 5% faster
MICRO_BATCH_FRACTIONS = (1, 2, 4, 8, 16)  # candidate micro-batches: an iteration's tokens / these, under the cap
REPEATS = 2  # the one-group forward/backward is timed this often (after a warm-up), the fastest kept
PASSES = 2  # every call size is sampled this often, alternately (biggest first, then smallest first), the fastest kept
PROBE_BUDGET_S, PROBE_SHARE = 30.0, 0.1  # a probe predicted to take longer than both this and this share of the
# run's sampling (from its first timed call) stops there, and the sizes are the rule's (`rule_sizes`)


class ProbeTooSlow(Exception):
    """The probe's first timed call (one iteration's sampling in one call, `seconds`) predicts `estimate` seconds of
    probing, over its budget: a 0.5B-wide model on 2 cores spent 262 s probing a 344 s run. The estimate is a lower
    bound: it costs every call size at the one-call time, and smaller calls cost more (the toy: 2.3x in all)."""
    def __init__(self, seconds: float, estimate: float):
        super().__init__(seconds, estimate)
        self.seconds, self.estimate = seconds, estimate


@dataclass(frozen=True)
class Probe:
    # prompts per call k -> iteration 0 sampled in calls of k, as the inference side would: when each group
    # was ready (seconds from the first call's start), its index and its call's first prompt, sorted by time
    timelines: dict[int, list[tuple[float, int, int]]]
    generate_seconds: dict[int, float]  # k -> seconds until the last call ended
    tokens: dict[int, list[int]]        # k -> each group's training tokens, G·P + ΣR
    train_seconds: tuple[float, float]  # a forward/backward of n padded tokens: d + c·n: (d, c)
    widths: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # k -> each group's row, P + max R
    group_size: int = 0  # G (0: no widths, micro-batches cost their tokens as if unpadded)

    @property
    def prompts(self) -> int:
        return max(self.tokens)  # the whole iteration in one call is always a candidate


def candidate_calls(prompts: int) -> list[int]:
    """Prompts per call worth probing: the whole iteration, then halves (16 -> 16, 8, 4, 2, 1).

    >>> candidate_calls(16), candidate_calls(6)
    ([16, 8, 4, 2, 1], [6, 3, 2, 1])
    """
    sizes = [prompts]
    while sizes[-1] > 1:
        sizes.append(math.ceil(sizes[-1] / 2))
    return sizes


def fastest(runs: dict[int, list[tuple[float, list]]]) -> tuple[dict[int, float], dict[int, list]]:
    """(seconds, timeline) of each call size's fastest run, from its runs [(seconds, timeline)]. Timing noise on
    a shared machine only ever adds time (another process took the core), so the least of several runs is the
    closest to the cost; the probe interleaves its passes so that a slow minute does not land on one size alone
    (the same call measured 0.82 s and 1.31 s a minute apart here).

    >>> fastest({16: [(1.31, ["slow"]), (0.82, ["fast"])], 8: [(0.9, ["a"]), (0.95, ["b"])]})
    ({16: 0.82, 8: 0.9}, {16: ['fast'], 8: ['a']})
    """
    best = {k: min(runs[k], key=lambda run: run[0]) for k in runs}
    return {k: run[0] for k, run in best.items()}, {k: run[1] for k, run in best.items()}


def padded_tokens(probe: Probe, size: int, groups: list[int]) -> int:
    """Tokens a forward over `groups` (indices) computes as plain rows padded to the longest (attention.py's
    unpacked layout): G·n·max width; their plain tokens when the probe has no widths."""
    if not probe.group_size:
        return sum(probe.tokens[size][g] for g in groups)
    return probe.group_size * len(groups) * max(probe.widths[size][g] for g in groups)


def predict_seconds(probe: Probe, calls: int, micro_tokens: int,
                    after_sampling: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """(iteration, generation, training) seconds predicted for `calls` generate calls and micro-batches of
    up to `micro_tokens` (async mode): the measured arrivals of that call size, trained by the learner's
    rule (the waiting groups are trained once they reach `micro_tokens`, or once their call has
    delivered all its groups), d + c·padded tokens per micro-batch, never before its groups arrived.
    `after_sampling`: the (d, c) of the micro-batches trained once the last group is in (the trainer then takes
    every core: launch.setup.train_threads_after_sampling), if they differ."""
    prompts = probe.prompts
    size = math.ceil(prompts / calls)
    tokens, timeline = probe.tokens[size], probe.timelines[size]
    trainer, training, waiting, arrived = 0.0, 0.0, [], {}  # waiting: group indices
    for position, (when, g, call) in enumerate(timeline):
        waiting.append(g)
        arrived[call] = arrived.get(call, 0) + 1
        call_done = arrived[call] == min(size, prompts - call)
        d, c = after_sampling if after_sampling and position == len(timeline) - 1 else probe.train_seconds
        while waiting and (call_done or sum(tokens[w] for w in waiting) >= micro_tokens):
            n = micro_batch_size([tokens[w] for w in waiting], micro_tokens)
            seconds = d + c * padded_tokens(probe, size, waiting[:n])
            trainer, training = max(trainer, when) + seconds, training + seconds
            del waiting[:n]
    return trainer, probe.generate_seconds[size], training


def best_sizes(probe: Probe, max_tokens: int, after_sampling: tuple[float, float] | None = None,
               min_calls: int = 1) -> tuple[int, int]:
    """(generate calls, micro-batch tokens): the fewest calls, then the biggest micro-batch, whose
    predicted iteration (`predict_seconds`, with its `after_sampling`) is within AS_FAST of the fastest; micro-batches
    never above `max_tokens`; at least `min_calls` calls (one per sampler of the ranks) when the probe has such."""
    prompts = probe.prompts
    total = sum(probe.tokens[prompts])
    calls = sorted({math.ceil(prompts / k) for k in probe.timelines})
    calls = [n for n in calls if n >= min_calls] or calls
    micro = sorted({min(max_tokens, math.ceil(total / f)) for f in MICRO_BATCH_FRACTIONS}, reverse=True)
    seconds = {(n, m): predict_seconds(probe, n, m, after_sampling)[0] for n in calls for m in micro}
    fastest = min(seconds.values())
    fewest_first = sorted(seconds, key=lambda nm: (nm[0], -nm[1]))
    return next(size for size in fewest_first if seconds[size] <= AS_FAST * fastest)


def sample_timeline(model, prompts, group_size, generation, cfg, size, hand_over=None):
    """Iteration 0 sampled in calls of `size` prompts (seeded as rollout.rollout_iteration seeds them):
    (when each group was ready, its index, its call's first prompt) in arrival order, the seconds until
    the last call ended, and the responses. `hand_over(index, responses)` runs where the inference side
    scores and sends each group (inside `generate`, which waits for it), and is timed with the sampling."""
    timeline, responses, start = [], [], time.perf_counter()
    for first in range(0, len(prompts), size):
        def ready(offset, group, first=first):
            if hand_over is not None:
                hand_over(first + offset, group)
            timeline.append((time.perf_counter() - start, first + offset, first))
        responses += sample_prompts(model, prompts[first:first + size], group_size, generation, cfg, 0, first,
                                    on_done=ready)
    return timeline, time.perf_counter() - start, responses


def hand_over_work(cfg, tokenizer, prompts, alive=lambda: None):
    """What a group costs the sampler between its last token and the trainer, the reward call aside (the trainer
    process may not hold the rewards, and a probe must not spend an API judge's calls): decoding its G responses,
    its advantages, a ScoredGroup message; async mode also pickles it and the trainer unpickles it (the queue). And
    `alive()`, which raises if the inference side died meanwhile (a probe can take minutes)."""
    import pickle

    import grpo
    from rollout import ScoredGroup

    def hand_over(index: int, responses: list[list[int]]) -> None:
        alive()
        tokenizer.batch_decode(responses, skip_special_tokens=True)
        zeros = [0.0] * len(responses)
        advantages = grpo.group_advantages(torch.tensor(zeros), cfg.group_size, cfg.scale_rewards).tolist()
        group = ScoredGroup(0, index, 0, prompts[index], responses, zeros, advantages, call=(0, len(prompts)),
                      rewards_per_function=[zeros])
        if cfg.mode == "async":
            pickle.loads(pickle.dumps(group))
    return hand_over


def _timed_backward(tri, batch, cfg) -> float:
    """Seconds of one micro-batch's forward/backward as the learner runs it (learner.forward_backward: the
    tri-model, the GRPO loss, its backward; advantages 0, which cost the same as any)."""
    start = time.perf_counter()
    forward_backward(tri, batch, [0.0] * sum(len(responses) for _, responses in batch), cfg)
    return time.perf_counter() - start


def probe(cfg, tri, tokenizer, train_examples, threads: int, probes: int = 1, alive=lambda: None) -> Probe:
    """Time iteration 0's generation at every candidate call size (when each group arrives) and its
    training (a forward/backward of one group, then of all in micro-batches of at most
    `cfg.micro_batch_tokens` or the default cap) at `threads` threads. Leaves the RNG, the weights and
    the gradients as they were. ProbeTooSlow after the first timed call when all `probes` would take more than
    PROBE_BUDGET_S and PROBE_SHARE of the run's sampling (each call size samples the whole iteration). `alive()`,
    after each group sampled and before the training is timed, raises if the inference side died meanwhile."""
    policy = tri.policy
    generation = sampling_config(cfg, stop_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    examples = [train_examples[i] for i in iteration_prompts(len(train_examples), cfg.prompts_per_iteration,
                                                              cfg.seed, 0)]
    prompts = run_prompt_ids(tokenizer, examples, cfg)  # as the run tokenizes them
    saved_threads, was_training = torch.get_num_threads(), policy.training
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            policy.eval()
            hand_over = hand_over_work(cfg, tokenizer, prompts, alive)
            sample_timeline(policy, prompts[:1], cfg.group_size, generation, cfg, 1, hand_over)  # warm-up
            runs, tokens, widths, responses = {}, {}, {}, None  # runs: size -> [(seconds, timeline)], one per pass
            order = sorted(set(candidate_calls(len(prompts))) | {min(cfg.groups_per_call or 1, len(prompts))},
                           reverse=True)
            for turn in range(PASSES):  # biggest calls first, then smallest first, ...
                for size in order if turn % 2 == 0 else order[::-1]:
                    timeline, seconds, sampled = sample_timeline(policy, prompts, cfg.group_size, generation,
                                                                 cfg, size, hand_over)
                    runs.setdefault(size, []).append((seconds, sorted(timeline)))
                    estimate = seconds * PASSES * len(order) * probes
                    if len(runs) == 1 and estimate > max(PROBE_BUDGET_S, PROBE_SHARE * cfg.iterations * seconds):
                        raise ProbeTooSlow(seconds, estimate)
                    tokens[size] = [cfg.group_size * len(p) + sum(len(r) for r in group)  # the same in every pass
                                    for p, group in zip(prompts, sampled)]
                    widths[size] = [len(p) + max(len(r) for r in group) for p, group in zip(prompts, sampled)]
                    responses = sampled if size == len(prompts) else responses  # one call's, for the training
            generate_seconds, timelines = fastest(runs)
            policy.train()
            device = next(policy.parameters()).device
            batch = [(torch.tensor(p, device=device), [torch.tensor(r, device=device) for r in group])
                     for p, group in zip(prompts, responses)]
            whole = tokens[len(prompts)]
            tri.start_iteration()
            alive()
            one_train_s = min(_timed_backward(tri, batch[:1], cfg) for _ in range(REPEATS + 1))  # the first: warm-up
            cap, cuts = cfg.micro_batch_tokens or MICRO_BATCH_TOKENS, [0]
            while cuts[-1] < len(batch):
                cuts.append(cuts[-1] + micro_batch_size(whole[cuts[-1]:], cap))
            all_train_s = min(sum(_timed_backward(tri, batch[i:j], cfg) for i, j in zip(cuts, cuts[1:]))
                              for _ in range(PASSES))
            policy.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(saved_threads)
        policy.train(was_training)
    # all_train_s = forwards·d + c·Σ padded, one_train_s = d + c·padded[0]: padded, as a forward computes them
    shape = Probe(timelines, generate_seconds, tokens, (0.0, 0.0), widths, cfg.group_size)
    padded = [padded_tokens(shape, len(prompts), list(range(i, j))) for i, j in zip(cuts, cuts[1:])]
    one = padded_tokens(shape, len(prompts), [0])
    forwards = len(padded)
    c = max(0.0, (all_train_s - forwards * one_train_s) / max(1, sum(padded) - forwards * one))
    return dataclasses.replace(shape, train_seconds=(max(0.0, one_train_s - c * one), c))


def predict_sample_then_train(probe: Probe, prompts: int, cap: int, calls: int | None = None,
                              min_calls: int = 1) -> tuple[int, float]:
    """(generate calls, predicted seconds) when the sides sample then train: the least generation (the
    fewest calls, at least `min_calls` where the probe has such, within AS_FAST of it, unless `calls` is given),
    then the whole iteration's training, cut into micro-batches of up to `cap` tokens by the learner's rule
    (`predict_seconds`)."""
    seconds = {k: s for k, s in probe.generate_seconds.items() if math.ceil(prompts / k) >= min_calls}
    seconds = seconds or probe.generate_seconds
    least = min(seconds.values())
    if calls is None:
        calls = math.ceil(prompts / max(k for k, s in seconds.items() if s <= AS_FAST * least))
    _, generate_s, train_s = predict_seconds(probe, calls, cap)
    return calls, generate_s + train_s  # one side after the other: no overlap


def choose(cfg, tri, tokenizer, train_examples, cores: int | None = None, min_calls: int = 1, alive=lambda: None
           ) -> tuple[object, str, float]:
    """`cfg` with the sizes `config.derive` left open (None) filled from probes, a line saying what was
    measured ('' when nothing was open), and the predicted speedup of the chosen schedule over sampling
    then training at the same sizes with every core per side (1.0 when it samples then trains, or nothing was
    probed):
    the pipeline's bound from measured phase times, streaming by completion counted. `cores`: the cores
    this process may use (default: all it may run on; a trainer rank's share of its host under torchrun);
    `min_calls`: at least this many generate calls (under torchrun, one per sampler: distributed.share_sizes);
    `alive()`: raises if the inference side died meanwhile (`probe`).

    Sync mode (and async when the threads are given or there is one core) probes at its own thread
    count. Async with the threads open probes twice: overlapped, at half the cores per side, and sampling
    then training, at all cores per side (the toy on 2 cores: overlapping two calls at one thread each is
    slower than one side after the other at two), and keeps the faster prediction."""
    if cfg.sized or fits_memory(cfg):  # (a GPU's micro-batch is fitted to its memory: launch/memory.py)
        return cfg, "", 1.0
    print(f"periodic-rl: probing sizes (the toy: 5-25 s; by rule instead if its first call predicts more than "
          f"{PROBE_BUDGET_S:.0f} s and {PROBE_SHARE:.0%} of the run's sampling; pass the printed flags to skip) ...",
          flush=True)  # then silent
    started, cores, prompts = time.perf_counter(), cores or available_cores(), cfg.prompts_per_iteration
    cap = cfg.micro_batch_tokens or MICRO_BATCH_TOKENS
    given = math.ceil(prompts / cfg.groups_per_call) if cfg.groups_per_call else None
    split_open = cfg.mode == "async" and cores > 1 and not (cfg.rollout_threads or cfg.train_threads)
    switches = split_open and cfg.inference_workers == 1 and cfg.train_threads_after_sampling in (None, cores)
    after_sampling = None  # the training's costs once sampling is done, when the trainer then takes every core
    try:
        if cfg.mode == "sync" or not split_open:
            threads = cfg.train_threads if cfg.mode == "async" else cores
            result = full = probe(cfg, tri, tokenizer, train_examples, threads=threads or cores, alive=alive)
        else:
            result = probe(cfg, tri, tokenizer, train_examples, threads=max(1, cores // 2), probes=2, alive=alive)
            full = probe(cfg, tri, tokenizer, train_examples, threads=cores, alive=alive)
            after_sampling = full.train_seconds if switches else None  # every core (setup.train_threads_after_sampling)
    except ProbeTooSlow as slow:
        return rule_sizes(cfg, cores, min_calls), (
            f"probe: one iteration's sampling took {slow.seconds:.1f} s, so probing every size would take at least "
            f"{slow.estimate:.0f} s, over its budget: sizes by rule instead (--sizes rule); stopped after "
            f"{time.perf_counter() - started:.1f} s"), 1.0
    if cfg.mode == "sync":
        calls, micro_tokens = predict_sample_then_train(result, prompts, cap, given, min_calls)[0], cap
    else:
        calls, micro_tokens = best_sizes(result, cap, after_sampling, min_calls)
        calls, micro_tokens = given or calls, cfg.micro_batch_tokens or micro_tokens
    iteration_s, gen_s, train_s = predict_seconds(result, calls, micro_tokens, after_sampling)
    overlaps = cfg.mode == "async" and iteration_s < (gen_s + train_s) / AS_FAST
    then_note = ""
    if split_open:
        then_calls, then_s = predict_sample_then_train(full, prompts, cap, given, min_calls)
        then_note = (f"; sample then train at {cores} threads: {then_s:.3f} s, overlapped at {max(1, cores // 2)} "
                     f"per side: {iteration_s:.3f} s ({calls} call(s), {micro_tokens}-token micro-batches)")
        if not overlaps or then_s <= iteration_s:
            calls, micro_tokens, overlaps, result = then_calls, cfg.micro_batch_tokens or cap, False, full
            gen_s = full.generate_seconds[math.ceil(prompts / calls)]
            iteration_s, train_s = then_s, then_s - gen_s
    gain = (predict_sample_then_train(full, prompts, micro_tokens, calls)[1] / iteration_s  # over the same sizes
            if overlaps else 1.0)
    rollout_threads = cfg.rollout_threads or (  # at least one thread per side (one core: both share it)
        max(1, min(cores - 1, round(cores * gen_s / (gen_s + train_s)))) if overlaps else cores)
    train_threads = cfg.train_threads or (max(1, cores - rollout_threads) if overlaps else cores)
    chosen = dataclasses.replace(
        cfg, groups_per_call=cfg.groups_per_call or math.ceil(prompts / calls),
        micro_batch_tokens=micro_tokens, rollout_threads=rollout_threads, train_threads=train_threads,
        train_threads_after_sampling=cfg.train_threads_after_sampling or (cores if overlaps and switches
                                                                          else train_threads))
    d, c = result.train_seconds
    steps = ", ".join(f"{k}: {seconds:.3f}" for k, seconds in sorted(result.generate_seconds.items(), reverse=True))
    note = (f"probe: generate seconds by prompts per call {{{steps}}}, forward/backward {d * 1e3:.1f} ms + "
            f"{c * 1e6:.2f} us/token; predicted {iteration_s:.3f} s per iteration (generate {gen_s:.3f} s, "
            f"train {train_s:.3f} s, "
            f"{f'overlapped: {gain:.2f}x sampling then training' if overlaps else 'sample then train'}"
            f"{then_note}); "
            f"probed in {time.perf_counter() - started:.1f} s")
    return chosen, note, gain


def rule_sizes(cfg, cores: int, min_calls: int):
    """`cfg` with the sizes still open filled as --sizes rule fills them on CPU (infra/options.derive): two generate
    calls per iteration (at least `min_calls`), the default micro-batch cap, the cores split in half when the sides
    overlap (all of them each when they sample then train: sync, or a single call)."""
    prompts = cfg.prompts_per_iteration
    per_call = cfg.groups_per_call or math.ceil(prompts / max(GENERATE_CALLS["cpu"], min_calls))
    sample_then_train = cfg.mode == "sync" or math.ceil(prompts / per_call) == 1
    rollout = cfg.rollout_threads or (cores if sample_then_train else max(1, cores // 2))
    train = cfg.train_threads or (cores if sample_then_train else max(1, cores - rollout))
    return dataclasses.replace(cfg, groups_per_call=per_call, micro_batch_tokens=cfg.micro_batch_tokens or
                               MICRO_BATCH_TOKENS, rollout_threads=rollout, train_threads=train,
                               train_threads_after_sampling=cfg.train_threads_after_sampling or train)


def choose_for_ranks(cfg, tri, tokenizer, train_examples, ranks, alive=lambda: None) -> tuple[object, str]:
    """(`choose`'s config and line) for this process, one of `ranks` (infra/distributed.py): under torchrun with the
    sizes to probe (--sizes probe on CPU, no inference ranks), trainer rank 0 probes on its share of its host's
    cores, at least one generate call per sampler, while the other ranks wait, and every rank takes its sizes
    (distributed.share_sizes: the same calls and micro-batch on every rank). `alive`: as `choose`'s."""
    probed_here = cfg.sizes == "probe" and cfg.rollout_device.startswith("cpu")  # (the same on every rank)
    if ranks.size == 1 or ranks.inference or not probed_here:
        return choose(cfg, tri, tokenizer, train_examples, alive=alive)[:2]
    chosen, note = None, ""
    if ranks.is_main:
        cores = max(1, available_cores() // ranks.local_size)
        chosen, note, _ = choose(cfg, tri, tokenizer, train_examples, cores, distributed.samplers(cfg, ranks), alive)
    cfg = distributed.share_sizes(cfg, ranks, chosen)
    distributed.check(cfg, ranks)
    return cfg, note


# --- the split of devices between the two sides (issue #16, point 6) ---
def balanced_split(generate_s: float, train_s: float, devices: int) -> tuple[int, int]:
    """(inference, training) devices out of `devices` that balance the two sides, from the device-seconds each
    side was busy per iteration (the timeline's generate_device_s and train_s), if each side's time divides
    by its device count (disjoint inference shares, data-parallel training): the i minimising the slower
    side, max(T_gen / i, T_train / (devices - i)); on a tie, fewer inference devices.

    >>> balanced_split(2.7, 1.0, 8)  # inference 2.7x slower than training: with 8 devices, 6 inference + 2 training
    (6, 2)
    """
    if devices < 2:
        raise ValueError(f"splitting needs at least 2 devices, got {devices}")
    inference = min(range(1, devices), key=lambda i: (max(generate_s / i, train_s / (devices - i)), i))
    return inference, devices - inference


def split_seconds(generate_s: float, train_s: float, calls: int, inference: int = 1, training: int = 1) -> float:
    """Seconds per iteration predicted with `inference` + `training` devices, from the busy seconds per iteration of
    each side on one device (T_gen, T_train): each side's time divides by its devices (disjoint shares of the
    generate calls; data-parallel training), and the sides overlap as a two-stage pipeline over rounds of
    `inference` calls sampled side by side. A round samples in a = T_gen / calls (one call's time) and trains in
    b = inference · T_train / (calls · training); R = ceil(calls / inference) rounds take
    a + b + (R - 1) · max(a, b): the first round's sampling (fill) and the last one's training (drain) overlap
    nothing. Streaming by completion inside a call is not counted (it only shortens the fill and the drain).

    >>> split_seconds(4.0, 1.0, calls=4), split_seconds(4.0, 1.0, calls=4, inference=2)
    (4.25, 2.5)
    >>> split_seconds(1.0, 4.0, calls=4, inference=1, training=2)
    2.25
    """
    a, b = generate_s / calls, inference * train_s / (calls * training)
    return a + b + (math.ceil(calls / inference) - 1) * max(a, b)


def split_report(generate_s: float, train_s: float, inference: int, training: int, calls: int = 1) -> str:
    """One line for the end of a run: how much slower one side is, the split that balances them, on this
    run's devices (`inference` + `training`) and on 8 (a node), and the seconds per iteration `split_seconds`
    predicts for each from this run's `calls` generate calls. `generate_s`, `train_s`: busy device-seconds
    per iteration, summed over the side's devices."""
    if min(generate_s, train_s) <= 0:
        return "split: one side was never busy: nothing to balance"
    slower, faster, ratio = (("inference", "training", generate_s / train_s) if generate_s >= train_s
                             else ("training", "inference", train_s / generate_s))
    here = balanced_split(generate_s, train_s, max(2, inference + training))
    node = balanced_split(generate_s, train_s, 8)
    calls = max(calls, 1)

    def predicted(split: tuple[int, int]) -> str:
        return f"{split_seconds(generate_s, train_s, max(calls, split[0]), *split):.3g} s per iteration"
    return (f"split: {slower} {ratio:.1f}x slower than {faster} ({generate_s:.3f} s inference, {train_s:.3f} s "
            f"training busy device-seconds per iteration): with {sum(here)} devices, {here[0]} inference + {here[1]} "
            f"training, {predicted(here)} (this run: {inference} + {training}); with 8 devices, {node[0]} inference + "
            f"{node[1]} training, {predicted(node)} (docs/distributed.md: the model)")


def memory_estimate(cfg, parameters: int, trainable: int) -> tuple[float, float]:
    """(the trainer's, the inference side's) memory in bytes, estimated from the model's `parameters` and the
    `trainable` ones (all of them, or a LoRA adapter's), for the first line:

        trainer    4·P             the float32 masters
                 + 12·T            their gradients and AdamW's two moments
                 + 4·P per copy    the frozen reference θ_0 (--beta > 0) and old θ_k (more than one optimizer step an
                                   iteration; tri_model.py), float32; with LoRA neither copies the model (4·T)
        inference  b·P per sampler its own copy in the sampling dtype (b = 2 in bfloat16, 4 in float32): each
                                   --inference-workers process in async (or auto) mode, one in sync
                 + b·P             the shared-memory buffer θ_k is published through (async mode)

    Activations are not counted: they grow with --micro-batch-tokens and shrink with --gradient-checkpointing.

    >>> from config import Config
    >>> [round(x / 1e9, 1) for x in memory_estimate(Config(dtype="bfloat16"), 494_000_000, 494_000_000)]
    [9.9, 2.0]
    """
    copies = (cfg.beta > 0) + (cfg.updates_per_iteration * cfg.num_iterations > 1)
    frozen = 4 * trainable * copies if cfg.lora else 4 * parameters * copies
    sampling = 2 if cfg.dtype == "bfloat16" else 4
    apart = cfg.mode != "sync"  # async, or auto not yet resolved: the larger of the two
    samplers = cfg.inference_workers if apart else 1
    return 4 * parameters + 12 * trainable + frozen, sampling * parameters * (samplers + apart)
