"""Headless Debian Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: commands on
fd 3, replies and events on fd 4, NUL-terminated JSON). No WebDriver, no extra Python package, no port."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["Chromium", "BrowserError", "find_chromium"]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,800"]


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, user_data_dir: Path, log: Path):
        exe = find_chromium()
        if exe is None:
            raise BrowserError("Debian's chromium is not installed (apt-get install -y chromium; scripts/test.sh "
                               "installs it)")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child_fds():
            # move both ends above 10 first, so that dup2 onto 3 and 4 cannot clobber one with the other
            a, b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._log = open(log, "wb")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe",
                                      "about:blank"], preexec_fn=child_fds, pass_fds=(3, 4),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        os.close(cmd_r)
        os.close(out_w)
        self._next_id = 0
        self._replies: dict = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
        with self._cond:
            self._replies[None] = {"error": {"message": "chromium closed the pipe"}}
            self._cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0):
        with self._cond:
            self._next_id += 1
            mid = self._next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies and None not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"{method}: no reply in {timeout} s")
                self._cond.wait(left)
            reply = self._replies.pop(mid, None) or self._replies[None]
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self, url: str) -> str:
        """A new page at `url`; returns the session id its commands go to."""
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        return self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, session: str, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      session)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def type_text(self, session: str, text: str) -> None:
        self.send("Input.insertText", {"text": text}, session)

    def press_enter(self, session: str) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13}
        self.send("Input.dispatchKeyEvent", {"type": "rawKeyDown", **key}, session)
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", **key}, session)

    def screenshot(self, session: str, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, session)["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        self._reader.join(5)
        os.close(self._out_r)
        self._log.close()
