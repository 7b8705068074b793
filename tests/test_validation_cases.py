"""The validation against published measurements (benchmarks/validation/published.toml,
docs/validation.md): the cases file parses, every case names a shipped model and GPU and a
source with an address, and replays of two cases land where the published figures say.

The replayed figures are compared with the *published* numbers, not with kvsim's own output:
a change of the timing model that moves them out of 25 % fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.errors import InputError
from sim.io.scenario import scenarios_dir
from sim.model.costs import GPU_PROFILES
from sim.tools.validation import TOLERANCE, load_cases, replay, throughput, throughput_and_hits, ttft_pair

CASES = Path(__file__).resolve().parents[1] / "benchmarks" / "validation" / "published.toml"


def case(case_id: str):  # type: ignore[no-untyped-def]
    return next(c for c in load_cases(CASES).cases if c.id == case_id)


def test_cases_file_parses_and_names_shipped_files() -> None:
    vf = load_cases(CASES)
    assert {c.metric for c in vf.cases} == {"ttft_reduction", "throughput_gain", "layout_ttft_reduction",
                                            "layout_throughput_gain"}
    for c in vf.cases:
        assert (scenarios_dir() / "models" / f"{c.model}.toml").is_file(), c.id
        assert c.gpu in GPU_PROFILES and (scenarios_dir() / "hardware" / f"{c.gpu}.toml").is_file(), c.id
        assert vf.sources[c.source].url.startswith("https://"), c.id
        assert c.reading, c.id


def refused(tmp_path: Path, text: str, match: str) -> None:
    """The cases file edited to ``text`` is refused with a message matching ``match``."""
    bad = tmp_path / "bad.toml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=match):
        load_cases(bad)


def test_a_case_without_its_metric_keys_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, CASES.read_text(encoding="utf-8").replace("hit_rate = 1.0\n", "", 1),
            "hit_rate and requests")


def test_vllm_blog_ttft_reduction_at_512_tokens_is_within_25_percent() -> None:
    # the blog: "TTFT for this prompt size [512 tokens] only decreased by X2" (Llama-3.1-8B, H100)
    r = replay(case("vllm-blog-ttft-512"), CASES.parent)
    assert r.case.published == 2.0
    assert abs(r.kvsim / 2.0 - 1) <= TOLERANCE
    assert r.within


def test_vllm_blog_ttft_reduction_at_100k_tokens_is_within_25_percent() -> None:
    # "reduces TTFT by X2-X22, depending on the prompt size": 22x at the largest, 100K tokens
    # (attention-bound prefill chunks of 16,384 tokens against a load of 13.4 GB)
    r = replay(case("vllm-blog-ttft-100k"), CASES.parent)
    assert r.case.published == 22.0
    assert abs(r.kvsim / 22.0 - 1) <= TOLERANCE, r.kvsim


def test_cpu_hit_is_a_load_not_a_prefill() -> None:
    # the CPU-hit TTFT of a 100K prompt is bounded below by its bytes over the link
    # (102,400 tokens x 131,072 B at the blog's 50 GB/s = 268 ms) and is far below the cold one
    cold, hit = ttft_pair(case("vllm-blog-ttft-100k"), CASES.parent)
    assert 102_400 * 131_072 / 50e9 < hit < 0.1 * cold


def test_vllm_blog_throughput_gain_at_full_hits_is_within_25_percent() -> None:
    # "the throughput increases by up to X9" (10,000 prompts of 512 tokens; 1,000 here: the gain
    # is a ratio of steady rates, so the batch size barely moves it)
    r = replay(case("vllm-blog-throughput-100"), CASES.parent, requests=1000)
    assert abs(r.kvsim / 9.0 - 1) <= TOLERANCE, r.kvsim


def test_a_planned_hit_that_found_nothing_is_counted_and_refused_by_the_strict_figure() -> None:
    # 30 % hits on 2,000 requests: more hits (600) than warmed prompts, so prompts cycle and the
    # batch's own stores can evict one before its second hit; the curve reports how many hit,
    # the validated figure refuses a batch whose hits are not all there
    c = case("vllm-blog-throughput-100")
    base = CASES.parent
    rate, hit, wanted = throughput_and_hits(c, base, 0.3, 2000)
    assert wanted == 600 and 0 < hit <= wanted and rate > 0
    if hit == wanted:
        assert throughput(c, base, 0.3, 2000) == rate
    else:
        with pytest.raises(RuntimeError, match=f"{hit} CPU hits in the batch, {wanted} planned"):
            throughput(c, base, 0.3, 2000)


def test_a_layout_case_without_its_baseline_is_refused(tmp_path: Path) -> None:
    text = CASES.read_text(encoding="utf-8")
    refused(tmp_path, text.replace('baseline = { model = { kv_transfer_piece = "kv" } }\n', "", 1),
            "baseline and up_to")


def test_vllm_0_12_layout_ttft_gain_is_within_25_percent() -> None:
    # "in 0.12.0 ... we saw up to X4 reduction in TTFT" (Llama-3.1-8B-Instruct, H100): 0.11's
    # 32 KiB pages (keys and values apart per layer) against 0.12's 2 MiB blocks; the gain grows
    # with the prompt (more bytes over the same per-piece cost), so the largest is at 100K
    r = replay(case("vllm-blog-0.12-layout-ttft"), CASES.parent)
    assert abs(r.kvsim / 4.0 - 1) <= TOLERANCE, r.kvsim
    assert r.at == 102_400 and r.numerator > 4 * r.denominator > 0


def test_vllm_0_12_layout_throughput_gain_is_within_25_percent() -> None:
    # "... and X5 increase in throughput" (10,000 prompts of 512 tokens; 1,000 here); with 0.11's
    # pieces the host link, not the GPU, bounds an all-hit batch
    r = replay(case("vllm-blog-0.12-layout-throughput"), CASES.parent, requests=1000)
    assert abs(r.kvsim / 5.0 - 1) <= TOLERANCE, r.kvsim
    assert r.at == 1.0



def test_a_layout_ttft_case_names_its_largest_point(tmp_path: Path) -> None:
    text = CASES.read_text(encoding="utf-8")
    i = text.index('id = "vllm-blog-0.12-layout-ttft"')
    refused(tmp_path, text[:i] + text[i:].replace("prompt_tokens = 102400", "prompt_tokens = 1024", 1),
            "largest point of up_to")


def test_the_eager_servers_cpu_hit_is_launch_bound() -> None:
    # agentic-kvc's server ran with --enforce-eager: kvsim's CPU-hit TTFT at 1k is then the load and
    # one launch-bound pass of Qwen3-30B-A3B's 48 layers (at least 48 x 0.75 ms), which brings it
    # within 30 % of the published 57 ms (6 ms, -89 %, with CUDA graphs). The cold 1k prefill runs at
    # the H20's measured GEMM rate (0.84 of peak): 51 ms against 78 ms published, its small expert
    # GEMMs (about 64 rows each) and the launches' partial overlap not modelled (docs/validation.md)
    c = case("agentic-kvc-ttft-1k")
    assert c.run["costs"]["enforce_eager"] is True
    cold, hit = ttft_pair(c, CASES.parent)
    assert hit >= 48 * GPU_PROFILES["h20"].host.eager_layer_s
    assert abs(hit / 0.057 - 1) <= 0.30, hit
    assert 0.6 <= cold / 0.078 <= 1.0, cold
    assert abs((cold / hit) / 1.368 - 1) <= TOLERANCE


def test_the_servers_tokenization_is_most_of_what_a_64k_cpu_hit_lacked() -> None:
    # agentic-kvc sent text to vLLM's OpenAI server, which tokenizes each prompt before the engine
    # sees it (1 us per token, assumed: 66 ms at 64k): with it the CPU-hit TTFT is within 25 % of the
    # published 272 ms and the ratio too; without it, 180 ms (-34 %) and the ratio +60 %
    c = case("agentic-kvc-ttft-64k")
    assert c.run["costs"]["tokenize"] is True
    cold, hit = ttft_pair(c, CASES.parent)
    assert abs(hit / 0.272 - 1) <= TOLERANCE, hit
    assert abs(cold / 15.2 - 1) <= TOLERANCE, cold
    assert abs((cold / hit) / 55.9 - 1) <= TOLERANCE
    text_free = c.model_copy(update={"run": {**c.run, "costs": {"enforce_eager": True}}})
    cold0, hit0 = ttft_pair(text_free, CASES.parent)
    tokenize = 65_536 * GPU_PROFILES["h20"].host.tokenize_token_s
    assert hit - hit0 == pytest.approx(tokenize, rel=1e-6)
    assert cold - cold0 == pytest.approx(tokenize, rel=1e-6)
    assert abs(hit0 / 0.272 - 1) > TOLERANCE and abs((cold0 / hit0) / 55.9 - 1) > TOLERANCE
