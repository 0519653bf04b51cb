"""``longstraw view``: a trajectory store in the browser, each group drawn as the prefix tree the trainer trains on.

- ``source``: ``ViewSource``, a store (and the ``metrics.jsonl`` beside it) as the viewer reads it: the index of
  runs and selected groups from SQL summaries, each group loaded when shown;
- ``group_view``: one group's page data: members with reward and the trainer's advantage, the segmenter's tree
  joined into branches, pieces by segment, windows of token text (``ViewLimits`` keeps a page small);
- ``tokens``: the text of each token (``TokenText``);
- ``page``: the self-contained HTML page (script, styles and data inline; ``static/``);
- ``server``: ``ViewerServer``, the page on loopback with groups and token ranges fetched on demand.

Like the agent side it runs without torch or a model (an import-linter contract in ``pyproject.toml``).
"""

from longstraw_agents.viewer.group_view import ViewLimits
from longstraw_agents.viewer.page import MAX_GROUPS, WrittenPage, static_page, write_page
from longstraw_agents.viewer.server import ViewerServer
from longstraw_agents.viewer.source import ViewSource

__all__ = ["MAX_GROUPS", "ViewLimits", "ViewSource", "ViewerServer", "WrittenPage", "static_page", "write_page"]
