"""A small TCP forwarder for tests/test_faults.py: `python fault_proxy.py LISTEN:TARGET ...`
forwards each 127.0.0.1:LISTEN to 127.0.0.1:TARGET. The test cuts the link by freezing
this process (SIGSTOP: nothing is forwarded either way, the connections stay open, as in
a network partition) and restores it with SIGCONT."""

from __future__ import annotations

import socket
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listen: int, target: int) -> None:
    srv = socket.create_server(("127.0.0.1", listen))
    while True:
        client, _ = srv.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", target))
        except OSError:
            client.close()
            continue
        print(f"connected {listen} -> {target}", flush=True)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    pairs = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[1:]]
    threads = [threading.Thread(target=_serve, args=p, daemon=True) for p in pairs]
    for t in threads:
        t.start()
    print("forwarding", pairs, flush=True)
    for t in threads:
        t.join()
