// batchinfer jobs page: while <main> carries data-refresh (a batch is running), re-fetch the page every
// data-refresh milliseconds and swap <main> in place; stops once the server renders it without the attribute.
(function () {
  "use strict";
  function schedule() {
    var main = document.querySelector("main");
    var delay = main && Number(main.dataset.refresh);
    if (delay > 0) {
      window.setTimeout(refresh, delay);
    }
  }
  function refresh() {
    fetch(window.location.href, { headers: { Accept: "text/html" } })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        var main = document.querySelector("main");
        if (fresh && main) {
          main.replaceWith(document.adoptNode(fresh));
        }
        schedule();
      })
      .catch(function () {
        // NOTE: the server may be restarting; try again after the same delay rather than stop refreshing.
        schedule();
      });
  }
  schedule();
})();
