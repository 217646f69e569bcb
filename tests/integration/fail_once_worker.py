"""A torchrun worker whose rank 1 raises in the first round (its error file carries the message) and that
succeeds in every later round."""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    time.sleep(0.2)
    if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        raise ValueError("bad batch in shard 7")


if __name__ == "__main__":
    main()
