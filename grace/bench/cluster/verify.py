"""Checking the links: TCP goodput and latency between two hosts (netprobe.py at both ends),
the verdict against the configuration, and the report printed from it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .errors import ClusterError, UnverifiedError, VerificationError
from .units import fmt_rate, fmt_time

NETPROBE = Path(__file__).resolve().parent / "netprobe.py"


class VerifyMixin:
    """EmulatedCluster's measurements and verification. Uses the cluster's config, bandwidth,
    latency, hosts, prefix, latency_method and delay_hold, the launchers' popen() and
    exec_prefix(), and the shaping's unshaped() and delay_lines_running()."""

    def measure_throughput(self, src: int = 0, dst: int = 1, seconds: float = 3.0, warmup: float = 0.5,
                           port: int = 5201) -> dict:
        """TCP goodput from host src to host dst (netprobe.py at both ends)."""
        py = sys.executable
        recv = self.popen(dst, [py, NETPROBE, "recv", "--bind", self.hosts[dst].ip, "--port", port,
                                "--warmup", warmup, "--timeout", seconds + 30],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = recv.stdout.readline().strip()
            if ready != "ready":
                raise ClusterError(f"throughput receiver did not start: {ready} {recv.stderr.read()}")
            send = subprocess.run(self.exec_prefix(src) + [py, str(NETPROBE), "send", "--host", self.hosts[dst].ip,
                                                           "--port", str(port), "--seconds", str(seconds)],
                                  capture_output=True, text=True, timeout=seconds + 60)
            out, err = recv.communicate(timeout=seconds + 60)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        if send.returncode != 0 or recv.returncode != 0:
            raise ClusterError(f"throughput probe {src}->{dst} failed: {send.stderr.strip()} {err.strip()}")
        return json.loads(out.strip().splitlines()[-1])

    def measure_latency(self, src: int = 0, dst: int = 1, count: int = 50, port: int = 5202) -> dict:
        """TCP round trips of 64-byte messages from src to dst; one-way = median RTT / 2."""
        py = sys.executable
        echo = self.popen(dst, [py, NETPROBE, "echo", "--bind", self.hosts[dst].ip, "--port", port],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if echo.stdout.readline().strip() != "ready":
                raise ClusterError(f"echo server did not start: {echo.stderr.read()}")
            ping = subprocess.run(self.exec_prefix(src) + [py, str(NETPROBE), "ping", "--host", self.hosts[dst].ip,
                                                           "--port", str(port), "--count", str(count)],
                                  capture_output=True, text=True, timeout=120)
            echo.communicate(timeout=30)
        finally:
            if echo.poll() is None:
                echo.kill()
                echo.wait()
        if ping.returncode != 0:
            raise ClusterError(f"latency probe {src}->{dst} failed: {ping.stderr.strip()}")
        r = json.loads(ping.stdout.strip().splitlines()[-1])
        r["one_way_median"] = r["rtt_median"] / 2
        return r

    def verify(self, src: int = 0, dst: int | None = None, seconds: float | None = None,
               tolerance: float | None = None, attempts: int | None = None, warmup: float | None = None,
               both_directions: bool = True, ceiling: str = "auto", headroom: float = 2.0,
               strict: bool = True) -> dict:
        """Measure TCP goodput and latency between two hosts and compare with the configuration.

        Throughput passes when the best of ``attempts`` readings per direction is within
        ``tolerance`` (10%) of the configured rate: other jobs on a shared machine can only lower
        a reading, never raise it above what tbf lets through, so a reading above the band
        fails at once. When no reading reaches the band, the links are unshaped for a moment to
        measure what this machine can carry at all (the ceiling: the best of that reading and the
        shaped ones). Below ``headroom`` (2) x the configured rate / (1 - tolerance) the link is
        CPU-bound: status 'cpu-bound', unverified (two tbf stages per direction cost CPU too, and
        on a shared machine one reading of the ceiling can be off by 2x either way). With more
        headroom than that a low reading is a real failure: status 'failed'.
        ``ceiling='always'`` measures it anyway. With ``strict`` a failure raises
        VerificationError and an unverifiable rate UnverifiedError (the report is attached).
        Latency: with netem, the median one-way time (RTT/2) must lie within
        [0.9 L - 20 us, 1.1 L + 300 us] (the upper allowance is Python's own round-trip overhead).
        """
        if not self._up:
            raise ClusterError("the cluster is not up")
        if self.n < 2:
            raise ClusterError("verification needs two hosts")
        v = self.config["defaults"]["verify"]
        seconds = float(seconds if seconds is not None else v["seconds"])
        tolerance = float(tolerance if tolerance is not None else v["tolerance"])
        attempts = int(attempts if attempts is not None else v["attempts"])
        warmup = float(warmup if warmup is not None else v["warmup"])
        dst = 1 if dst is None else dst
        band = (1 - tolerance) * self.bandwidth, (1 + tolerance) * self.bandwidth
        directions = [(src, dst)] + ([(dst, src)] if both_directions else [])
        measured = [self._direction_report(a, b, attempts, seconds, warmup, band) for a, b in directions]
        report = {"prefix": self.prefix, "configured_bps": self.bandwidth, "tolerance": tolerance,
                  "seconds": seconds, "directions": measured, "ceiling_bps": None}
        low = any(d["status"] == "low" for d in report["directions"])
        if low or ceiling == "always":
            self._measure_ceiling(report, src, dst, seconds, warmup)
        for d in report["directions"]:
            if d["status"] == "low":
                self._judge_low(d, report["ceiling_bps"], tolerance, headroom)
        states = {d["status"] for d in report["directions"]}
        status = "failed" if "failed" in states else "cpu-bound" if "cpu-bound" in states else "verified"
        report["status"] = status
        report["measured_bps"] = min(d["measured_bps"] for d in report["directions"])

        lat_report = self._latency_report(src, dst)
        report["latency"] = lat_report
        report["certified"] = status == "verified" and lat_report["status"] in ("verified", "native")
        if strict:
            if status == "failed" or lat_report["status"] == "failed":
                raise VerificationError("link verification failed:\n" + format_report(report), report)
            if status == "cpu-bound":
                raise UnverifiedError("link rate cannot be verified (CPU-bound):\n" + format_report(report), report)
        return report

    def _direction_report(self, a: int, b: int, attempts: int, seconds: float, warmup: float, band: tuple) -> dict:
        """Up to ``attempts`` readings from host a to host b (until one reaches the band); the best is judged:
        'verified' in the band, 'failed' above it, 'low' below it (judged later, against the ceiling)."""
        lo, hi = band
        readings = []
        for _ in range(attempts):
            r = self.measure_throughput(a, b, seconds, warmup)
            readings.append(r["goodput_bps"])
            if r["goodput_bps"] >= lo:      # in the band, or above it (which fails below)
                break
        best = max(readings)
        d = {"src": self.hosts[a].name, "dst": self.hosts[b].name, "readings_bps": readings,
             "measured_bps": best, "ratio": best / self.bandwidth}
        if best > hi:
            d["status"] = "failed"
            d["why"] = "faster than configured: the link is not shaped"
        elif best >= lo:
            d["status"] = "verified"
        else:
            d["status"] = "low"
        return d

    def _measure_ceiling(self, report: dict, src: int, dst: int, seconds: float, warmup: float) -> None:
        """What this machine carries at all: one reading with the shaping removed, into the report."""
        with self.unshaped(src, dst):
            unshaped = self.measure_throughput(src, dst, seconds, warmup)["goodput_bps"]
        report["unshaped_bps"] = unshaped
        # a shaped reading is also a lower bound of what the machine carries (load varies)
        report["ceiling_bps"] = max([unshaped] + [x for d in report["directions"] for x in d["readings_bps"]])

    def _judge_low(self, d: dict, ceiling_bps: float, tolerance: float, headroom: float) -> None:
        """A direction below the band: CPU-bound where the machine has too little headroom, else failed."""
        if ceiling_bps < self.bandwidth / (1 - tolerance):
            d["status"] = "cpu-bound"
            d["why"] = (f"this machine carries at most {fmt_rate(ceiling_bps)} between two "
                        f"namespaces (measured with the shaping removed); the link is CPU-bound, "
                        f"not shaped")
        elif ceiling_bps < headroom * self.bandwidth / (1 - tolerance):
            d["status"] = "cpu-bound"
            d["why"] = (f"this machine carries {fmt_rate(ceiling_bps)} unshaped, less than "
                        f"{headroom:g}x the rate: too little headroom for the shaper itself, so the "
                        f"link is CPU-bound")
        else:
            d["status"] = "failed"
            d["why"] = (f"below {100 * (1 - tolerance):.0f}% of the configured rate although the "
                        f"machine carries {fmt_rate(ceiling_bps)} unshaped")

    def _latency_report(self, src: int, dst: int) -> dict:
        """The one-way latency measured and judged: within [0.9 L - 20 us, 1.1 L + 300 us] where emulated."""
        lat = self.measure_latency(src, dst)
        one_way = lat["one_way_median"]
        L = self.latency
        lat_report = {"configured_one_way_s": L, "measured_one_way_s": one_way, "rtt_median_s": lat["rtt_median"],
                      "rtt_min_s": lat["rtt_min"], "emulated": self.latency_emulated,
                      "method": self.latency_method, "delay_hold_s": self.delay_hold}
        if self.latency_emulated:
            ok = 0.9 * L - 20e-6 <= one_way <= 1.1 * L + 300e-6
            stopped = [h for h, up in self.delay_lines_running().items() if not up]
            lat_report["status"] = "verified" if ok and not stopped else "failed"
            if stopped:
                lat_report["why"] = f"the delay lines of {', '.join(stopped)} are not running"
        else:
            lat_report["status"] = "native" if L == 0 else "not-emulated"
        return lat_report



def format_report(r: dict) -> str:
    lines = [f"cluster {r['prefix']}: configured {fmt_rate(r['configured_bps'])} per link, "
             f"tolerance {100 * r['tolerance']:.0f}%, {r['seconds']:g} s per reading"]
    for d in r["directions"]:
        readings = ", ".join(fmt_rate(x) for x in d["readings_bps"])
        lines.append(f"  {d['src']} -> {d['dst']}: {fmt_rate(d['measured_bps'])} TCP goodput "
                     f"({100 * d['ratio']:.1f}% of configured; readings {readings}): {d['status'].upper()}"
                     + (f" - {d['why']}" if d.get("why") else ""))
    if r.get("ceiling_bps"):
        lines.append(f"  what this machine carries between two namespaces: {fmt_rate(r['ceiling_bps'])} "
                     f"(unshaped reading {fmt_rate(r['unshaped_bps'])})")
    lat = r.get("latency")
    if lat:
        lines.append(f"  latency one-way: configured {fmt_time(lat['configured_one_way_s'])}, measured "
                     f"{fmt_time(lat['measured_one_way_s'])} (TCP RTT median {fmt_time(lat['rtt_median_s'])}, "
                     f"min {fmt_time(lat['rtt_min_s'])}): {lat['status'].upper()}"
                     + (f" ({lat['method']}" + (f", each packet held {fmt_time(lat['delay_hold_s'])}"
                                                   if lat.get("delay_hold_s") is not None else "") + ")"
                        if lat.get("method") else "")
                     + (f" - {lat['why']}" if lat.get("why") else "")
                     + ("" if lat["emulated"] or lat["configured_one_way_s"] == 0 else
                        " - neither sch_netem nor the delay line; the links keep their native latency"))
    lines.append("  => " + ("CERTIFIED" if r.get("certified") else
                            "UNVERIFIED (CPU-bound: do not trust benchmark numbers at this rate)"
                            if r["status"] == "cpu-bound" else
                            "bandwidth verified, latency NOT emulated" if r["status"] == "verified" else "FAILED"))
    return "\n".join(lines)
