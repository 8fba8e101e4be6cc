"""Scrape latency of an exporter, over one kept-alive connection.

    python3 scrape_latency.py URL [N]

Prints the p50, p99 and max of N scrapes (default 2000) in milliseconds.
"""
import http.client, sys, time, urllib.parse

u = urllib.parse.urlparse(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
ms = []
for _ in range(n):
    t = time.perf_counter()
    conn.request("GET", u.path or "/metrics")
    conn.getresponse().read()
    ms.append((time.perf_counter() - t) * 1000)
ms.sort()
print(f"{n} scrapes: p50 {ms[n // 2]:.2f} ms, p99 {ms[int(n * 0.99)]:.2f} ms, max {ms[-1]:.2f} ms")
