"""StrictModes along a whole path, and bytes verified before they are used: every way another user
could have placed or swapped a file is refused, naming the place; the user's own private path passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import trust
from harness.trust import TrustError

ANOTHER_UID = 12345


@pytest.fixture
def private(tmp_path: Path) -> Path:
    """A folder of the user's, writable by nobody else, with a module file in it."""
    folder = tmp_path / "own"
    folder.mkdir(mode=0o700)
    (folder / "mod.py").write_text("x = 1\n")
    (folder / "mod.py").chmod(0o644)
    return folder


def test_the_users_own_private_path_passes(private: Path) -> None:
    trust.check_path(private / "mod.py")
    trust.check_path(private)


@pytest.mark.parametrize(
    ("plant", "place", "why"),
    [
        (lambda f: f.chmod(0o777), ".", "mode 0777 is writable by others without the sticky bit"),
        (lambda f: f.chmod(0o775), ".", "mode 0775 is writable by others without the sticky bit"),
        (lambda f: os.chown(f, ANOTHER_UID, -1), ".", f"owned by uid {ANOTHER_UID}"),
        (lambda f: os.chown(f / "mod.py", ANOTHER_UID, -1), "mod.py", f"owned by uid {ANOTHER_UID}"),
        (lambda f: (f / "mod.py").chmod(0o666), "mod.py", "mode 0666 is writable by others"),
    ],
    ids=["folder-0777", "folder-group-writable", "folder-foreign", "file-foreign", "file-0666"],
)
def test_a_place_another_user_could_write_is_refused_by_name(private: Path, plant, place: str, why: str) -> None:
    plant(private)
    with pytest.raises(TrustError, match=why) as refused:
        trust.check_path(private / "mod.py")
    assert refused.value.path == (private / place).resolve()


def test_a_folder_far_above_counts_as_much_as_the_nearest(private: Path) -> None:
    deep = private / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "mod.py").write_text("")
    private.chmod(0o777)
    with pytest.raises(TrustError, match="writable by others") as refused:
        trust.check_path(deep / "mod.py")
    assert refused.value.path == private


def test_a_sticky_shared_folder_above_is_fine_as_tmp_is(private: Path) -> None:
    private.chmod(0o1777)
    trust.check_path(private / "mod.py")


def test_a_symbolic_link_is_judged_where_it_leads(private: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "mod.py").write_text("")
    (private / "link.py").symlink_to(shared / "mod.py")
    with pytest.raises(TrustError, match="writable by others") as refused:
        trust.check_path(private / "link.py")
    assert refused.value.path == shared


def test_verified_bytes_are_the_bytes_signed(private: Path, tmp_path: Path) -> None:
    key = trust.user_key(tmp_path / "key")
    payload = b"index bytes"
    (private / "index").write_bytes(payload)
    signed = trust.tag(key, "index", payload)
    assert trust.verified_payload(private / "index", key, "index", signed) == payload
    (private / "index").write_bytes(payload + b"!")
    with pytest.raises(TrustError, match="tag does not match"):
        trust.verified_payload(private / "index", key, "index", signed)
    with pytest.raises(TrustError, match="tag does not match"):  # the same bytes under another name
        (private / "index").write_bytes(payload)
        trust.verified_payload(private / "index", key, "other", signed)


def test_a_key_others_may_read_is_refused(tmp_path: Path) -> None:
    trust.user_key(tmp_path / "key")
    (tmp_path / "key").chmod(0o644)
    with pytest.raises(TrustError, match="expected mode 0600"):
        trust.user_key(tmp_path / "key")
