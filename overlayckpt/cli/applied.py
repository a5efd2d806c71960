"""How an apply's result reads on a terminal (apply, and unmount's apply)."""
from __future__ import annotations

from overlayckpt.messages import ApplyReply
from overlayckpt.names import quote_path


def applied_text(r: ApplyReply, what: str = "") -> str:
    """An apply's result for a terminal: counts, then what it refused or made less."""
    lines = [f"applied {what}to {quote_path(r['repo'])}: {r['written']} written, {r['removed']} removed"]

    def some(paths: list[str]) -> str:
        return ", ".join(quote_path(p) for p in paths[:5]) + (
            f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    refused = r["refused"]
    if refused:
        why = sorted({x["why"] for x in refused})
        lines.append(f"refused {len(refused)} (left as the repo has them): "
                     f"{some([x['path'] for x in refused])} ({'; '.join(why[:3])})")
    if r["setid_dropped"]:
        lines.append(f"setuid/setgid bits dropped from {len(r['setid_dropped'])} (the repo's copy "
                     f"did not have them): {some(r['setid_dropped'])}")
    return "\n".join(lines)
