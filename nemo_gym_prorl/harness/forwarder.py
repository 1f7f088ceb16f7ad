"""The forwarder a sandbox runs for its model proxy: it listens on 127.0.0.1:PORT in the sandbox's own network
namespace and hands that listening socket to the proxy (SCM_RIGHTS over the proxy's hand-over socket, its directory
bound into the sandbox). The proxy then accepts a harness's ``OPENAI_BASE_URL=http://127.0.0.1:PORT/v1``
connections itself: no process copies bytes in between (piping them through one cost ~0.7 ms a call), and the
sandbox's loopback still reaches the proxy and nothing else.

The proxy copies this file into the sandbox, whose python3 may be any 3.8+ (the image's Debian 3.11, the host's):
standard library only, nothing of our package. It stays until the proxy closes the hand-over connection (or it is
killed: the proxy's close, the sandbox's end), so the sandbox's process list shows whom the port belongs to.

    python3 forwarder.py HANDOVER_SOCKET PORT
"""

import array
import socket
import sys


def main(handover_path, port):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    proxy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    proxy.connect(handover_path)
    fds = array.array("i", [listener.fileno()])
    proxy.sendmsg([b"L"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
    listener.close()  # the proxy's copy is the listener from now on
    proxy.recv(1)  # b"" once the proxy closes the hand-over connection


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        raise SystemExit("usage: python3 forwarder.py HANDOVER_SOCKET PORT")
    main(sys.argv[1], int(sys.argv[2]))
