// The console's own script: live pages over server-sent events, and the time slider. Everything works
// without it (plain forms and links); with it, pages follow the log and actions answer in place (htmx).
(function () {
  "use strict";
  var body = document.body;

  // Actions carry the session's CSRF token as a header too (the forms carry it as a field).
  body.addEventListener("htmx:configRequest", function (e) {
    e.detail.headers["X-CSRF-Token"] = body.dataset.csrf || "";
  });

  // Fetch this page again and put its <main> in place of ours: what changed shows without a reload.
  var refreshing = false, again = false;
  function refresh() {
    if (refreshing) { again = true; return; }
    refreshing = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Console-Refresh": "1" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("main"), main = document.getElementById("main");
        if (!fresh || !main) return;
        var focused = document.activeElement && document.activeElement.id;
        var typed = keep(main);
        main.innerHTML = fresh.innerHTML;
        restore(main, typed);
        if (window.htmx) window.htmx.process(main);
        if (focused && document.getElementById(focused)) document.getElementById(focused).focus();
        body.dataset.refreshed = String(Number(body.dataset.refreshed || 0) + 1);
      })
      .catch(function () {})
      .finally(function () {
        refreshing = false;
        if (again) { again = false; refresh(); }
      });
  }

  // What a person has typed or chosen and not yet sent survives an update: each changed field is known
  // by its id, else by its form's action and its name, and put back into the fresh page.
  function fieldKey(field) {
    if (field.id) return "#" + field.id;
    var form = field.form;
    return (form ? form.getAttribute("action") + "|" + (form.id || "") : "") + "|" + field.name;
  }
  function changed(field) {
    if (field.type === "hidden" || field.type === "submit" || field.type === "button") return false;
    if (field.type === "checkbox" || field.type === "radio") return field.checked !== field.defaultChecked;
    if (field.tagName === "SELECT") {
      for (var i = 0; i < field.options.length; i++) {
        if (field.options[i].selected !== field.options[i].defaultSelected) return true;
      }
      return false;
    }
    return field.value !== field.defaultValue;
  }
  function keep(root) {
    var typed = {};
    root.querySelectorAll("input, select, textarea").forEach(function (field) {
      if (field.name && changed(field)) {
        typed[fieldKey(field)] = field.type === "checkbox" || field.type === "radio" ? field.checked : field.value;
      }
    });
    return typed;
  }
  function restore(root, typed) {
    root.querySelectorAll("input, select, textarea").forEach(function (field) {
      var key = fieldKey(field);
      if (!(key in typed)) return;
      if (field.type === "checkbox" || field.type === "radio") field.checked = typed[key];
      else field.value = typed[key];
    });
  }

  var state = document.getElementById("live-state");
  function say(which) { if (state) { state.textContent = state.dataset[which] || ""; state.dataset.state = which; } }

  if (body.dataset.live === "on" && window.EventSource && body.dataset.page) {
    var timer = null;
    // The browser reconnects by itself (after a restart too) and sends Last-Event-ID: nothing is missed.
    var source = new EventSource("/console/live?page=" + encodeURIComponent(body.dataset.page));
    source.addEventListener("open", function () { say("on"); });
    source.addEventListener("hello", function () { say("on"); refresh(); });
    source.addEventListener("change", function () {
      clearTimeout(timer);
      timer = setTimeout(refresh, 150);
    });
    source.addEventListener("error", function () { say("lost"); });
  }

  // After an action answers in place, show the page as it is now.
  body.addEventListener("htmx:afterRequest", function (e) {
    if (e.detail.target && e.detail.target.id === "outcome") refresh();
  });

  // The time slider: minutes back from now, written into the moment field (UTC), shown on release.
  var back = document.getElementById("at-back"), at = document.getElementById("at");
  var out = document.getElementById("at-back-value"), form = document.getElementById("moment");
  if (back && at && form) {
    back.addEventListener("input", function () {
      var minutes = Number(back.value);
      if (minutes === 0) { at.value = ""; if (out) out.textContent = "0"; return; }
      var when = new Date(Date.now() - minutes * 60000);
      at.value = when.toISOString().slice(0, 19);
      if (out) out.textContent = "-" + minutes + " min";
    });
    back.addEventListener("change", function () { form.submit(); });
  }
})();
