"""The HTML view: one self-contained page of a run (`Recording.to_html`) or of a comparison
(`CompareReport.to_html`), to open in any browser without a server or a network, and the same view
embedded in a notebook cell (`_repr_html_`: `recording_view`, `report_view`, bounded in rows).

`recording_page` and `report_page` return the page as text; the `to_html` methods write it. This
package reads events and reports through their attributes only, so that the results and the
comparison can import it without an import cycle.
"""

from .notebook import recording_view, report_view
from .recording_page import recording_page
from .report_page import report_page

__all__ = ["recording_page", "recording_view", "report_page", "report_view"]
