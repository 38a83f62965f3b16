// Refreshes a run page's curves: fetches the fragment named by data-src every data-every ms
// and swaps it in, until the fragment says the run's workflow is no longer running.
// Read-only GETs; nothing else runs in the page.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var every = parseInt(live.getAttribute("data-every"), 10) || 2000;
  var src = live.getAttribute("data-src");
  function running() {
    var status = live.querySelector("#run-status");
    return !status || status.getAttribute("data-running") !== "no";
  }
  function refresh() {
    fetch(src, { cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null) {
          live.innerHTML = html;
          live.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { /* the next tick tries again */ })
      .finally(function () { if (running()) setTimeout(refresh, every); });
  }
  if (running()) setTimeout(refresh, every);
})();
