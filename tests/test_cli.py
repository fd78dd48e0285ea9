"""The command line parses what the README shows, and passes draft formats to the engine."""
import pytest

from saguaro.cli import DEMO_DRAFT_WEIGHTS, DEMO_FAN_OUT, DEMO_SD_K, _engine_options, build_parser, main


def test_generate_flags_reach_the_engine_options():
    args = build_parser().parse_args(["generate", "--target", "a", "--draft", "b", "--mode", "ssd", "--k", "3",
                                      "--fan-out", "1,1,1,2", "--enforce-eager", "--draft-weights", "int8",
                                      "--draft-vocab", "65536", "--prompt", "x"])
    opts = _engine_options(args)
    assert opts["fan_out"] == [1, 1, 1, 2] and opts["num_speculative_tokens"] == 3 and opts["enforce_eager"]
    assert opts["draft_weights"] == "int8" and opts["draft_vocab"] == 65536
    assert opts["adaptive"]  # adaptive K unless --fixed-k
    fixed = build_parser().parse_args(["generate", "--target", "a", "--mode", "sd", "--fixed-k", "--prompt", "x"])
    assert _engine_options(fixed)["adaptive"] is False


@pytest.mark.parametrize("flag, argv, replacement", [
    ("--fallback", ["generate", "--target", "a", "--fallback", "ngram", "--prompt", "x"], "--miss-strategy"),
    ("--speculator", ["generate", "--target", "a", "--speculator", "ngram", "--prompt", "x"], "--proposer"),
    ("--compile", ["generate", "--target", "a", "--compile", "--prompt", "x"], "--enforce-eager"),
    ("--compile", ["serve", "--model", "a", "--compile"], "--enforce-eager"),
    ("--compile", ["calibrate", "--compile"], "--enforce-eager"),
])
def test_removed_flags_name_their_replacement(flag, argv, replacement, capsys):
    """--fallback, --speculator and --compile warned for a release; now the parser refuses them with the new flag."""
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} was removed" in err and replacement in err
    args = build_parser().parse_args(["generate", "--target", "a", "--miss-strategy", "ngram", "--prompt", "x"])
    assert _engine_options(args)["miss_strategy"] == "ngram"


def test_demo_defaults_are_consistent():
    args = build_parser().parse_args(["demo"])
    assert args.k == DEMO_SD_K and args.ssd_fan_out == DEMO_FAN_OUT
    assert args.draft_weights == DEMO_DRAFT_WEIGHTS == "int4"
    assert build_parser().parse_args(["demo", "--ssd-fan-out", "1,1,3"]).ssd_fan_out == [1, 1, 3]


def test_serve_flags_and_dtype_default(monkeypatch):
    args = build_parser().parse_args(["serve", "--model", "a", "--served-model-name", "coder", "--api-key", "k"])
    assert args.served_model_name == "coder" and args.api_key == "k" and _engine_options(args)["dtype"] == "auto"
    monkeypatch.setenv("SAGUARO_API_KEY", "from-env")
    assert build_parser().parse_args(["serve", "--model", "a"]).api_key == "from-env"


def test_serve_limit_and_deadline_flags(capsys):
    args = build_parser().parse_args(["serve", "--model", "a", "--max-choices", "4", "--request-body-timeout", "3",
                                      "--shutdown-timeout", "2", "--health-stall-timeout", "5",
                                      "--max-prefill-tokens", "256", "--max-request-bytes", "4096"])
    assert args.max_request_bytes == 4096
    assert (args.max_choices, args.request_body_timeout, args.shutdown_timeout, args.health_stall_timeout,
            args.max_prefill_tokens) == (4, 3.0, 2.0, 5.0, 256)
    assert main(["serve", "--model", "a", "--shutdown-timeout", "0"]) == 2  # refused before any model loads
    assert "shutdown_timeout_s must be > 0" in capsys.readouterr().err
