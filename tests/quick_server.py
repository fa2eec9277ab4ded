"""How the tests' own HTTP servers run: `threading.Thread(target=server.serve_forever, kwargs=QUICK_SHUTDOWN)`.

socketserver's `serve_forever` looks for a shutdown every 0.5 s, so each `shutdown()` waited up to half a second:
9 s of tests/test_openai_tools.py's 20, about 0.45 s for every test that stops a server. Every 50 ms instead.
"""
QUICK_SHUTDOWN = {"poll_interval": 0.05}
