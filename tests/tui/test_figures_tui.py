"""Every figure readable: the status bar at 80-200 columns, the reply growing in it while it
streams, a message sent too early kept, and the cache view laid out for its width."""

import re

import pytest
from rich.cells import cell_len
from test_tui import settle, status_text, type_and_send
from textual.app import App, ComposeResult
from textual.geometry import Region

from localchat.cacheview.prefillfit import PrefillModel
from localchat.cacheview.report import CacheReport, LayerKind, TurnView
from localchat.events import Usage
from localchat.tui.cachescreen import CacheScreen, turn_bars
from localchat.tui.composer import Composer
from localchat.tui.statusbar import Part, StatusBar, fit, usage_parts

USAGE = Usage(prompt_tokens=12_412, cached_tokens=12_380, prefilled_tokens=32,
              completion_tokens=257, ttft_s=0.123, prefill_tps=251.0, decode_tps=45.1,
              context_tokens=12_669, context_length=32_768, cache_bytes=291_000_000,
              bytes_written=700_000, miss_reason="edited", checkpoints=True,
              draft_tokens=12, reasoning_tokens=120)


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 200])
def test_the_bar_keeps_hit_ttft_and_speed_and_drops_the_rest_first(width):
    parts = usage_parts(USAGE) + [Part("ctx 12669/32768", 4), Part("smollm2-135m", 5)]
    line = fit(parts, width)
    assert cell_len(line) <= width
    assert "hit" in line and "TTFT 0.12s" in line and "decode 45.1 tok/s" in line
    assert line.startswith(("cached 12380 / prefilled 32 (100% hit)", "100% hit"))
    shown = line.split(" · ")
    # Whole parts only, in their order (nothing cut mid-figure).
    texts = [p.text for p in parts] + ["100% hit"]
    assert all(s in texts for s in shown)
    # What is dropped is never more useful than what is kept.
    ranks = {p.text: p.rank for p in parts} | {"100% hit": 0}
    dropped = [p for p in parts if p.text not in shown and not (p.short and p.short in shown)]
    if dropped:
        assert min(p.rank for p in dropped) >= max(ranks[s] for s in shown if ranks[s] != 0)


def test_a_wide_bar_shows_everything_and_a_narrow_one_does_not():
    parts = usage_parts(USAGE)
    whole = " · ".join(p.text for p in parts)
    assert fit(parts, 400) == whole  # (the negative control: nothing dropped when it fits)
    assert fit(parts, 80) != whole and cell_len(whole) > 80
    assert "checkpoints" not in fit(parts, 80) and "KV" not in fit(parts, 80)


def test_prompt_lookup_shows_drafts_taken_only_when_it_drafted():
    import dataclasses

    looked = dataclasses.replace(USAGE, lookup_drafted=40, lookup_accepted=31)
    assert "lookup 31/40 taken" in fit(usage_parts(looked), 400)
    assert "lookup" not in fit(usage_parts(USAGE), 400)  # (no drafts: nothing said)
    # The least useful part: dropped before the hit, TTFT and speed at 80 columns.
    assert "lookup" not in fit(usage_parts(looked), 80)


def test_fewer_blas_threads_are_said_with_why_and_shortened_on_a_narrow_bar():
    import dataclasses

    why = "BLAS 1 thread: 5.8 tok/s vs 1.0 with 2, other processes using 1.4 cores"
    dropped = dataclasses.replace(USAGE, blas_threads=why)
    assert why in fit(usage_parts(dropped), 400)
    narrow = fit(usage_parts(dropped), 80)
    assert "BLAS 1 thread" in narrow and "other processes" not in narrow
    assert "hit" in narrow and "decode 45.1 tok/s" in narrow
    assert "BLAS" not in fit(usage_parts(USAGE), 400)  # (every thread: nothing said)


async def test_at_80_columns_the_app_shows_hit_ttft_and_decode(make_app):
    app, _ = make_app(["Paris is the capital of France and its largest city by far."])
    async with app.run_test(size=(80, 30)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "What is the capital of France?")
        await settle(app, pilot)
        shown = status_text(app)
        assert "hit" in shown and "TTFT" in shown and "decode" in shown
        bar = app.query_one(StatusBar)
        assert cell_len(shown) <= bar.content_size.width == 78


async def test_the_bar_shows_the_reply_growing_not_the_last_turn(make_app):
    long = " ".join(f"word{i}" for i in range(60))
    app, _ = make_app(["first answer", long], delay=0.03)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Hi")
        await settle(app, pilot)
        assert "TTFT" in status_text(app)  # the first turn's figures
        await type_and_send(pilot, "Talk a lot")
        seen = []
        for _ in range(2000):  # a bound, not a timing
            await pilot.pause(0.02)
            text = status_text(app)
            if not app.busy:
                break
            seen.append(text)
        growing = [int(m.group(1)) for t in seen if (m := re.search(r"replying: (\d+) tokens",
                                                                       t))]
        assert len(set(growing)) >= 3 and growing == sorted(growing)
        assert any(re.search(r"replying: \d+ tokens · [\d.]+ tok/s", t) for t in seen)
        # While the reply runs, never the previous turn's figures.
        assert not any("TTFT" in t or "hit" in t for t in seen)
        await settle(app, pilot)
        final = app.query_one(StatusBar).usage
        assert "TTFT" in status_text(app) and final.completion_tokens >= max(growing)


async def test_a_message_sent_during_a_reply_stays_in_the_box_with_a_hint(make_app):
    long = " ".join(f"word{i}" for i in range(60))
    app, _ = make_app([long, "second"], delay=0.03)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Talk a lot")
        for _ in range(500):
            await pilot.pause(0.02)
            if "replying" in status_text(app):
                break
        # Pasted, then Enter: a key press waits for the app to be idle, which a streaming
        # reply is not, so typing it key by key could outlast the reply.
        app.query_one(Composer).load_text("too early")
        await pilot.press("enter")
        await pilot.pause()
        assert app.busy  # (the reply was still running when Enter came)
        hint = str(app.query_one("#draft").render())
        assert app.query_one(Composer).text == "too early"
        assert "reply is running" in hint and "\n" not in hint
        await settle(app, pilot)
        assert [m.content for m in app.store.messages(app.current)][-2:] == ["Talk a lot", long]
        assert app.query_one(Composer).text == "too early"  # still there, now sendable
        assert "reply is running" not in str(app.query_one("#draft").render())
        await pilot.press("enter")
        await settle(app, pilot)
        assert [m.content for m in app.store.messages(app.current)][-2:] == ["too early",
                                                                            "second"]


# -- the cache view --------------------------------------------------------------------------

def report() -> CacheReport:
    turns = [TurnView(105, 0, 105, 0, 40, 0.84, 0.0, 0.0),
             TurnView(12_412, 12_380, 32, 12, 257, 0.123, 51.234, 51.111),
             TurnView(12_950, 12_669, 281, 0, 1_024, 1.234, 54.321, 53.087)]
    kinds = [LayerKind("growing (KVCache)", 30, 23_040, 0, 291_000_000),
             LayerKind("sliding window 512 (RotatingKVCache)", 6, 0, 4_718_592, 0)]
    return CacheReport("trip", "HuggingFaceTB/SmolLM2-135M-Instruct", 13_974, 32_768,
                       [0, 37, 12_412], [(0, 105, 2_419_200), (105, 13_974, 288_580_800)],
                       [(104, 4_718_592), (13_974, 4_718_592)], kinds, 291_000_000, turns,
                       PrefillModel(0.012, 0.0039, 2.1e-8, "calibration", 4, 1), 41_234)


class ViewApp(App):
    CSS_PATH = "../../localchat/tui/app.tcss"

    def compose(self) -> ComposeResult:
        bar = StatusBar(id="status")
        bar.model = "smollm2-135m"
        bar.show_usage(USAGE)
        yield bar

    def on_mount(self) -> None:
        self.push_screen(CacheScreen(report()))


FIGURE = re.compile(r"(TTFT \d+\.\d\d s|full ~\d+\.\d\d s \(est\.\)|saved ~\d+\.\d\d s \(est\.\)"
                    r"|cached [\d,]+|prefilled [\d,]+|~\d+\.\d\d s this turn|~\d+\.\d\d s in all"
                    r"|[\d,]+ B/token|[\d.]+ [KMG]?B on disk|[\d,]+ tokens of [\d,]+)")


def figures_in(text: str) -> list[str]:
    return FIGURE.findall(text)


@pytest.mark.parametrize("width", [80, 100, 130, 200])
async def test_the_cache_view_never_wraps_inside_a_figure(width):
    app = ViewApp()
    async with app.run_test(size=(width, 60)) as pilot:
        await pilot.pause()
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        drawn, whole = [], []
        for w in screen.query("Flowed"):
            lines = [s.text.rstrip() for s in w.render_lines(Region(0, 0, w.size.width,
                                                                      w.size.height))]
            assert all(cell_len(line) <= w.content_size.width for line in lines)
            drawn += lines
            whole.append(str(w.render()))
        found = [f for line in drawn for f in figures_in(line)]
        # Every figure the view holds is drawn whole on one line.
        expected = [f for text in whole for f in figures_in(text)]
        assert sorted(found) == sorted(expected)
        assert len(found) >= 15
        assert "estimated" in " ".join(drawn) and "calibration" in " ".join(drawn)
        assert all("(est.)" in line for line in drawn if "full ~" in line)


async def test_a_quit_while_the_view_calibrates_stops_the_calibration(make_app, home,
                                                                     monkeypatch):
    """A first F3 calibrates the model (8.5-13 s on the default model here) on the model's
    thread; a quit meanwhile stops it between two runs, keeps nothing, and the thread is free
    (before, every remaining run went on after the quit and Python waited for them at exit:
    the default model's app took 10.4 s to exit in a pty, 0.4 s now). Each run is made slow
    (0.2 s) so the quit lands in the middle; the runs are counted, not timed."""
    import time

    from localchat.cacheview import prefillmodel

    app, _ = make_app(["Paris."])
    open_at_run = []  # per calibration run: whether the app was still open when it began
    real = prefillmodel.run_prefill

    def slow(engine, tokens, clock, cache=None):
        open_at_run.append(app.is_open)
        time.sleep(0.2)
        return real(engine, tokens, clock, cache)

    monkeypatch.setattr(prefillmodel, "run_prefill", slow)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "What is the capital of France?")
        await settle(app, pilot)
        await pilot.press("f3")
        for _ in range(100):
            await pilot.pause(0.05)
            if len(open_at_run) >= 3:
                break
        assert len(open_at_run) >= 3
        await pilot.press("ctrl+q")
    app.mlx.call(lambda: None)  # (after the calibration's job: the thread is free)
    # (at most one: a run whose check came a moment before the quit; without the stop, 17)
    assert open_at_run.count(False) <= 1, open_at_run
    assert len(open_at_run) < 2 + len(prefillmodel.CALIBRATION) * prefillmodel.REPEATS
    assert not list((home / "prefill-models").glob("*.json"))  # nothing half-measured kept


def test_the_control_a_turn_line_is_wider_than_80_columns_unflowed():
    """(why the view lays lines out: the turn's figures in one line do not fit 80 columns)"""
    one_line = " · ".join(str(line) for line in turn_bars(report(), 200)[2:3])
    assert cell_len(one_line) > 80
    assert all(line.cell_len <= 80 for line in turn_bars(report(), 80))


@pytest.mark.parametrize("width", [80, 120])
def test_figures_snapshot(snap_compare, width):
    """The cache view over the status bar, pixel for pixel, at 80 and 120 columns."""
    assert snap_compare(ViewApp(), terminal_size=(width, 48))


# -- near the end of the context ---------------------------------------------------------------

# A Korean chat on the default model: 5,940 of 8,192 tokens is ~3,000 Korean characters (2.0
# tokens each, measured on bench_edges.py's sentences; English there: 0.2 per character).
NEAR_FULL = Usage(prompt_tokens=5_702, cached_tokens=5_650, prefilled_tokens=52,
                  completion_tokens=238, ttft_s=0.412, prefill_tps=251.0, decode_tps=18.3,
                  context_tokens=5_940, context_length=8_192, cache_bytes=136_857_600,
                  bytes_written=6_635_520, miss_reason="")


class NearApp(App):
    CSS_PATH = "../../localchat/tui/app.tcss"

    def __init__(self, usage: Usage):
        super().__init__()
        self.usage = usage

    def compose(self) -> ComposeResult:
        bar = StatusBar(id="status")
        bar.model = "smollm2-135m"
        bar.show_usage(self.usage)
        yield bar


@pytest.mark.parametrize("width", [60, 80, 120])
async def test_near_the_limit_the_bar_says_how_full_the_context_is_at_any_width(width):
    import dataclasses

    for usage, said in ((NEAR_FULL, "context 72%"),
                        # (the control: half full, the figure is the first thing dropped)
                        (dataclasses.replace(NEAR_FULL, context_tokens=4_096), None)):
        app = NearApp(usage)
        async with app.run_test(size=(width, 3)) as pilot:
            await pilot.pause()
            line = str(app.query_one(StatusBar).render())
            assert cell_len(line) <= width and "TTFT 0.41s" in line
            if said:
                assert said in line and "ctx" not in line
            else:
                assert "context" not in line
                assert ("ctx 4096/8192" in line) == (width >= 120)


def test_near_the_limit_snapshot(snap_compare):
    """The status bar of a Korean chat at 72% of the default model's context, 80 columns."""
    assert snap_compare(NearApp(NEAR_FULL), terminal_size=(80, 3))
