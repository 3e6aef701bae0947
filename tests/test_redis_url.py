"""Redis URLs in errors and logs never show the password."""

from __future__ import annotations

import pytest

from workqueue import connect
from workqueue.embedded import redact_url


def test_an_unreachable_redis_is_named_without_its_password():
    with pytest.raises(ConnectionError) as e:
        connect("redis://fleet:topsecret@127.0.0.1:1/0")
    assert "topsecret" not in str(e.value) and "redis://fleet:***@127.0.0.1:1/0" in str(e.value)


def test_redact_url_hides_passwords_in_both_places():
    assert redact_url("rediss://:pw@host:6380/0") == "rediss://:***@host:6380/0"
    assert redact_url("redis://host/0?password=pw&db=1") == "redis://host/0?password=***&db=1"
    assert redact_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"


@pytest.mark.parametrize("secret", ["se/cret", "se#cret", "se?cret", "se@cret", "a:b"])
def test_a_password_with_reserved_characters_is_hidden_too(secret):
    url = f"redis://gw:{secret}@127.0.0.1:1/0"
    assert redact_url(url) == "redis://gw:***@127.0.0.1:1/0"
    with pytest.raises(ConnectionError) as e:  # the parser's own error may quote a piece of it
        connect(url)
    assert secret not in str(e.value) and "cret" not in str(e.value), str(e.value)
