// Refreshes a run page's curves: fetches the fragment named by data-src every data-every ms
// and swaps it in. Read-only GETs; nothing else runs in the page.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var every = parseInt(live.getAttribute("data-every"), 10) || 2000;
  var src = live.getAttribute("data-src");
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
      .finally(function () { setTimeout(refresh, every); });
  }
  setTimeout(refresh, every);
})();
