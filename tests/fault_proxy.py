"""A small TCP forwarder for the fault tests: `python fault_proxy.py LISTEN:TARGET ...`
forwards each 127.0.0.1:LISTEN to 127.0.0.1:TARGET. Importable as `Proxy` for in-process
tests. Three faults:

- a stall: the test freezes the process (SIGSTOP: nothing is forwarded either way, the
  connections stay open, as in a network partition) and restores it with SIGCONT;
- a black hole (SIGUSR1, `Proxy.swallow`): bytes are still read from both sides, so
  the senders believe they were written, but dropped — what a link that dies with
  data in flight loses;
- a reset (SIGUSR2, `Proxy.reset`): every connection is closed with a TCP RST, the
  black hole ends, and for `--down-s` seconds new connections are refused (the link
  is cut), then accepted again.
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys
import threading
import time


class Proxy:
    def __init__(self, listen: int, target: int, down_s: float = 0.0) -> None:
        self.listen, self.target, self.down_s = listen, target, down_s
        self.srv = socket.create_server(("127.0.0.1", listen))
        self.listen = self.srv.getsockname()[1]
        self.black_hole = threading.Event()
        self.swallowed = 0
        self.resets = 0
        self._down_until = 0.0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            if time.monotonic() < self._down_until:  # the link is cut: refused
                _rst(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                _rst(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            print(f"connected {self.listen} -> {self.target}", flush=True)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if self.black_hole.is_set():
                    self.swallowed += len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def swallow(self) -> None:
        self.black_hole.set()

    def reset(self, down_s: float | None = None) -> None:
        """Every connection gets a RST; new ones are refused for `down_s` seconds."""
        self._down_until = time.monotonic() + (self.down_s if down_s is None else down_s)
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _rst(s)
        self.black_hole.clear()
        self.resets += 1
        print(f"reset {len(conns) // 2} connections of {self.listen}; swallowed {self.swallowed} bytes", flush=True)

    def close(self) -> None:
        try:
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.srv.close()
        self.reset(0)


def _rst(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)  # wakes the pump blocked in recv on it
    except OSError:
        pass
    s.close()  # with linger 0: a RST, not a FIN


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", help="LISTEN:TARGET")
    ap.add_argument("--down-s", type=float, default=2.0)
    args = ap.parse_args()
    proxies = [Proxy(*(int(x) for x in p.split(":")), down_s=args.down_s) for p in args.pairs]
    signal.signal(signal.SIGUSR1, lambda *_: [p.swallow() for p in proxies])
    signal.signal(signal.SIGUSR2, lambda *_: [p.reset() for p in proxies])
    print("forwarding", args.pairs, flush=True)
    sys.stdout.flush()
    while True:
        signal.pause()
