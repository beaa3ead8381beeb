"""Snakemake's HTML report (`snakemake --report report.html`) as a person opens it: headless
Chromium loads the page, goes to Results > <experiment> > Plots and opens each plot with its eye
button; what the page then shows is read back (the image's natural size in pixels)."""

from __future__ import annotations

import time
from pathlib import Path

from browser import headless_chromium, screenshot

# label -> file of each plot (workflow/rules/report.smk)
PLOTS = {"training curves": "training.png", "quantization trade-off": "quantization.png",
         "stage time and memory": "stages.png"}


def shown_plots(html: Path, experiment: str, plots: dict[str, str] = PLOTS) -> dict[str, tuple[int, int]]:
    """{label: (width, height)} of the PNG the report page shows when a person opens each plot."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def click(driver, xpath: str) -> None:
        WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.XPATH, xpath))[0].click()

    shown = {}
    with headless_chromium("1400,1000") as driver:
        driver.get(Path(html).resolve().as_uri())
        click(driver, "//*[text()='Results']")
        time.sleep(0.5)
        if not driver.find_elements(By.XPATH, "//*[text()='Plots']"):  # one experiment opens directly
            click(driver, f"//*[text()='{experiment}']")
        click(driver, "//*[text()='Plots']")
        for label, file in plots.items():
            click(driver, f"//tr[td[text()='{label}']]//a[@iconname='eye']")
            image = WebDriverWait(driver, 20).until(
                lambda d: [i for i in d.find_elements(By.TAG_NAME, "img")
                           if f"filename={file}" in (i.get_attribute("src") or "")
                           and d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", i)])[0]
            shown[label] = tuple(driver.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]",
                                                       image))
            screenshot(driver, f"report_{label.replace(' ', '_')}")
    return shown
