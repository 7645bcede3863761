"""s3_fault_proxy.py - an HTTP proxy in front of an S3 server (tests/s3_test.sh), for the s3://
backend's retries: of every 9 requests it answers one with 503 SlowDown without passing it
on, drops the connection of another before passing it on, and passes a third on but drops
the connection instead of answering (the request took effect, its answer is lost). Prints
one line per fault. Usage: python s3_fault_proxy.py LISTEN_PORT UPSTREAM_PORT"""
import http.client
import http.server
import itertools
import socket
import sys
import threading

UPSTREAM = ("127.0.0.1", int(sys.argv[2]))
counter = itertools.count()
lock = threading.Lock()


def fault(kind, handler):
    with lock:
        print(kind, handler.command, handler.path, flush=True)


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def drop(self):
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def handle_one(self):
        n = next(counter)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if n % 9 == 2:
            fault("503", self)
            msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(msg)
            return
        if n % 9 == 5:
            fault("drop-before", self)
            return self.drop()
        conn = http.client.HTTPConnection(*UPSTREAM, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        conn.request(self.command, self.path, body=body if length else None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if n % 9 == 7:
            fault("drop-after", self)
            return self.drop()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date",
                                 "server"):
                self.send_header(k, v)
        # a HEAD's Content-Length is the object's
        self.send_header("Content-Length", resp.getheader("Content-Length", "0")
                         if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one


http.server.ThreadingHTTPServer.daemon_threads = True
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Proxy).serve_forever()
