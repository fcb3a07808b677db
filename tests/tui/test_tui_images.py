"""Images in the app (issue 49), driven with Pilot: ``/image PATH`` and a dropped path attach
an image (its chip above the message box), the turn carries it as ``ask --image`` does, and a
reopened app shows its chip and resumes from the cache with the reply of a cold run; bad input
is one line and stores nothing; a huge image is said once; the cache view shows an image as
one span. The composer's parser on generated text never crashes or attaches wrongly."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from textual import events
from tinyvlm import FAMILIES, build_tiny_vlm, random_png

from localchat.store.images import check
from localchat.tui.app import LocalchatApp
from localchat.tui.attach import command_of, pasted_path
from localchat.tui.chatview import UserMessage
from localchat.tui.composer import Composer
from localchat.tui.imagechips import ImageChips
from localchat.tui.statusbar import StatusBar

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """``vlms(family)``: a tiny random model of that vision family, built once per module."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / family, family)
        return made[family]
    return get


@pytest.fixture(scope="module")
def qwen(vlms) -> Path:
    return vlms("qwen2_vl")


def vlm_app(model: Path, **kw) -> LocalchatApp:
    # Greedy, so a reply can be compared with a cold run's; no draft prefill (its hit counts).
    return LocalchatApp(model=str(model), temp=0.0, max_tokens=MAX_TOKENS, draft_prefill=False,
                        **kw)


def recording(app) -> list[str]:
    """Every notice ``app`` shows from now on, recorded (and shown)."""
    said: list[str] = []
    shown = app.notify

    def notify(message, **kw):
        said.append(message)
        shown(message, **kw)

    app.notify = notify
    return said


async def settle(app, pilot):
    await app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


async def enter(app, pilot, text: str) -> None:
    """``text`` pasted into the message box (as a terminal delivers a drop), then Enter."""
    app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")
    await settle(app, pilot)


def attached(app) -> ImageChips:
    return app.query_one("#attached", ImageChips)


def message_chips(app) -> list[list[str]]:
    return [w.chips for w in app.query(".message-images")]


def stored_images(home: Path) -> list[Path]:
    return sorted((home / "images").glob("*")) if (home / "images").exists() else []


@pytest.mark.parametrize("family", FAMILIES)
async def test_image_turn_then_reopen_resumes_from_the_cache_as_a_cold_run(home, vlms, family,
                                                                          tmp_path):
    from localchat.session.session import TurnOptions, open_session

    qwen = vlms(family)  # (each vision family)
    pic = random_png(tmp_path / "cat.png")
    digest = check(pic)[2].digest
    chip = check(pic)[2].chip  # "cat.png 90×60 N KB"
    app = vlm_app(qwen)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await enter(app, pilot, f"/image {pic}")
        assert attached(app).display and attached(app).chips == [chip]
        assert app.query_one(Composer).text == ""
        assert "cat.png 90×60" in str(attached(app).render())
        await enter(app, pilot, "What is in it?")
        first = app.query_one(StatusBar).usage
        stored = app.store.messages(app.current)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content
        assert stored[0].images == [digest] and stored[0].content == "What is in it?"
        assert not attached(app).display  # sent: nothing attached any more
        assert message_chips(app) == [[chip]]  # on the sent message, by its file name
        name = app.current.name
        await pilot.press("ctrl+q")
    assert len(stored_images(home)) == 1

    app = vlm_app(qwen, conversation=name)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        # Reopened: the chip from the stored copy (the hash stands for the file name).
        [[shown]] = message_chips(app)
        assert shown.startswith(f"{digest[:12]} 90×60 ")
        assert [str(m.render()) for m in app.query(UserMessage)] == ["What is in it?"]
        await enter(app, pilot, "And now?")
        second = app.query_one(StatusBar).usage
        resumed = app.store.messages(app.current)[-1].content
        await pilot.press("ctrl+q")
    # The resumed prefill covers the image turn: its prompt and reply came from the cache
    # (SmolVLM's template renders a stored reply after "Assistant: " with a space the model
    # did not write: its hit ends where the reply starts).
    reply = 0 if family == "smolvlm" else first.completion_tokens - 2
    assert second.cached_tokens >= first.prompt_tokens + reply
    assert second.prefilled_tokens < first.prompt_tokens

    # The same conversation cold (no cache, a full prefill): the same greedy reply.
    session = open_session(str(qwen))
    try:
        conv = session.store.find(name)
        cold, _ = session.fork(conv, "cold", at=2)
        options = TurnOptions(**session.engine.sampling().turn_fields(
            max_tokens=MAX_TOKENS, temp=0.0), no_cache=True)
        finished = [e for e in session.turn(cold, "And now?", options)][-1]
    finally:
        session.close()
    assert finished.usage.cached_tokens == 0
    assert finished.reply == resumed


def truncated(tmp_path: Path) -> Path:
    data = random_png(tmp_path / "whole.png").read_bytes()
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) // 2])
    return path


BAD = {
    "not an image": (lambda p: (p / "notes.txt").write_text("hello") and p / "notes.txt",
                     "notes.txt: not an image"),
    "a truncated PNG": (truncated, "cut.png: damaged or truncated image"),
    "a missing path": (lambda p: p / "nowhere.png", "No such file"),
    "a text-only model": (lambda p: random_png(p / "fine.png"),
                          "is a text model: it cannot take images"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_image_is_one_line_and_nothing_is_stored(case, home, make_app, tmp_path):
    make, says = BAD[case]
    path = make(tmp_path)
    app, _ = make_app(["never"], draft_prefill=False)  # (a text model)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        said = recording(app)
        await enter(app, pilot, f"/image {path}")
        assert len(said) == 1 and says in said[0] and "\n" not in said[0]
        assert not attached(app).display and app.attachments.items == []
        assert app.query_one(Composer).text == f"/image {path}"  # kept, to be corrected
        assert app.store.messages(app.current) == []
    assert stored_images(home) == []


async def test_text_model_refuses_an_image_attached_before_it_loaded(home, make_app, tmp_path):
    """Attached while no model was loaded, the send is refused in one line: the text and the
    image come back, nothing is stored."""
    app, _ = make_app(["never"], draft_prefill=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        session, app.session = app.session, None  # (as while a model loads)
        await enter(app, pilot, f"/image {random_png(tmp_path / 'fine.png')}")
        assert len(app.attachments.items) == 1
        app.session = session
        said = recording(app)
        await enter(app, pilot, "Look")
        assert len(said) == 1 and "is a text model: it cannot take images" in said[0]
        assert app.store.messages(app.current) == []
        assert app.query_one(Composer).text == "Look" and len(app.attachments.items) == 1
    assert stored_images(home) == []


async def test_a_dropped_path_attaches_and_a_path_in_a_sentence_is_sent(home, make_app,
                                                                       tmp_path):
    pic = random_png(tmp_path / "my photo.png")
    app, _ = make_app(["ok"], draft_prefill=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        session, app.session = app.session, None  # (attach without a model's say)
        await enter(app, pilot, f"'{pic}'")  # as a terminal drops a name with a space
        assert len(app.attachments.items) == 1
        await enter(app, pilot, "/image clear")
        assert app.attachments.items == [] and not attached(app).display
        await enter(app, pilot, pic.as_uri())  # file:///…/my%20photo.png
        assert len(app.attachments.items) == 1
        await enter(app, pilot, "/image clear 1")
        app.session = session
        # The negative control: a path among other words is a message, sent as text.
        text = f"Please look at {pic} tomorrow"
        await enter(app, pilot, text)
        assert app.attachments.items == []
        assert [m.content for m in app.store.messages(app.current)] == [text, "ok"]
        assert app.store.messages(app.current)[0].images == []


async def attach_and_send(app, pilot, picture: Path, text: str) -> list[str]:
    """Once the model is loaded: ``picture`` attached, ``text`` sent; the notices said."""
    await settle(app, pilot)
    said = recording(app)
    await enter(app, pilot, f"/image {picture}")
    await enter(app, pilot, text)
    # (the turn ran: its message stored with the image; a random model's reply may be empty)
    assert [m.images for m in app.store.messages(app.current)][:1] == [[check(picture)[2].digest]]
    assert app.query_one(StatusBar).usage.prompt_tokens > 0
    return said


async def test_a_huge_image_is_said_once_and_the_cache_view_shows_its_span(home, qwen,
                                                                          tmp_path):
    app = vlm_app(qwen)
    async with app.run_test(size=(120, 40)) as pilot:
        big = random_png(tmp_path / "big.png", 400, 300)
        said = await attach_and_send(app, pilot, big, "Read it")
        scaled = [s for s in said if "scales it down" in s]
        assert len(scaled) == 1 and "400×300" in scaled[0], said
        await enter(app, pilot, "And?")  # (said for the message that brings it, not again)
        assert len([s for s in said if "scales it down" in s]) == 1
        await pilot.press("f3")
        await settle(app, pilot)
        screen = app.screen
        images = str(screen.query_one("#cache-images").render())
        marks = str(screen.query_one("#cache-marks").render())
        report = screen.report
    # One span, not 12 placeholder tokens (the tiny Qwen's 6×8 patches, merged 2×2).
    [span] = report.images
    assert span.end - span.start == 12
    assert "[image big.png 400×300: 12 tokens]" in images
    assert "▣" in marks


async def test_a_small_image_is_not_said_to_be_scaled(home, qwen, tmp_path):
    """The control of the notice above: a 90×60 image loses little (rounded to patches)."""
    app = vlm_app(qwen)
    async with app.run_test(size=(120, 40)) as pilot:
        said = await attach_and_send(app, pilot, random_png(tmp_path / "small.png"), "Read it")
        assert not [s for s in said if "scales it down" in s]


# -- the parser, on any text ---------------------------------------------------------------

NASTY = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)
MARKUP = st.sampled_from(["[b]", "[/]", "[red]x[/red]", "[link=file:///x]y[/link]", "\x1b[31m",
                          "\0", "\\ ", "'", '"', "~", "file://", "/image", "\n", "\t", "%20"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.one_of(NASTY, MARKUP), max_size=6))
def test_the_parser_never_crashes_nor_attaches_what_is_not_one_image_path(pieces):
    text = "".join(pieces)
    command = command_of(text)  # never raises
    if command is None:
        return
    if text.strip().startswith("/image"):
        assert command.action in ("add", "clear", "list", "refuse")
        return
    # Attached without /image: only a single existing image file dropped whole.
    assert command.action == "add" and command.path.is_file()
    assert command.path.suffix.lower() in {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp",
                                           ".tif", ".tiff"}


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.text(alphabet=string.ascii_letters + " ,[]", max_size=20),
       after=st.text(alphabet=string.ascii_letters + " ,[]", max_size=20),
       quote=st.sampled_from(["", "'", '"']))
def test_a_real_image_path_attaches_only_when_it_is_the_whole_text(before, after, quote,
                                                                   tmp_path):
    pic = tmp_path / "p i c.png"
    if not pic.exists():
        random_png(pic)
    whole = f"{quote}{pic}{quote}"
    assert pasted_path(f"  {whole}\n".rstrip("\n")) == pic
    assert pasted_path(str(pic).replace(" ", "\\ ")) == pic  # a backslash-escaped drop
    text = f"{before}{whole}{after}"
    if text.strip() != whole:
        command = command_of(text)
        assert command is None or command.path != pic or text.strip().startswith("/image")
