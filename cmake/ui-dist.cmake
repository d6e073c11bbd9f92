# Build-time step before upstream's llama-ui-assets (cmake -P): puts the web page that ci/ui.sh built (SRC, the
# S3D8_UI_DIST folder) where upstream's scripts/ui-assets.cmake looks for npm's output (DST, <build>/.../tools/ui/dist),
# newer than every UI source, so that ui-assets.cmake (run with BUILD_UI=ON) takes it as up to date ("UI: npm output
# up-to-date, skipping build") and embeds it. It must never fall through to running npm in the build (network):
# the same up-to-date test as ui-assets.cmake's npm_build_should_skip() is made here, and a failure stops the build.
#   -DSRC=<ci/ui.sh's dist> -DDST=<UI binary dir>/dist -DUI_SOURCE_DIR=<patched tree>/tools/ui
cmake_minimum_required(VERSION 3.18)

if (NOT EXISTS "${SRC}/index.html")
    message(FATAL_ERROR "s3d8: the web page ${SRC} is gone since this build folder was configured: run "
                        "`bash ci/ui.sh` (or ci/setup.sh) to rebuild it, or reconfigure to build without it")
endif()

file(REMOVE_RECURSE "${DST}")
file(COPY "${SRC}/" DESTINATION "${DST}")
file(TOUCH "${DST}/index.html")
get_filename_component(ui_binary_dir "${DST}" DIRECTORY)
file(REMOVE "${ui_binary_dir}/.ui-stamp")  # ui-assets.cmake's stamp of a Hugging Face download (would run npm)

# npm_build_should_skip(): every source listed in tools/ui/sources.cmake no newer than index.html
if (NOT EXISTS "${UI_SOURCE_DIR}/sources.cmake")
    message(FATAL_ERROR "s3d8: ${UI_SOURCE_DIR}/sources.cmake is missing: upstream's ui-assets.cmake would run npm")
endif()
include("${UI_SOURCE_DIR}/sources.cmake")
set(globs "")
foreach (g ${UI_SOURCE_GLOBS})
    list(APPEND globs "${UI_SOURCE_DIR}/${g}")
endforeach()
file(GLOB_RECURSE sources ${globs})
foreach (f ${UI_SOURCE_FILES})
    list(APPEND sources "${UI_SOURCE_DIR}/${f}")
endforeach()
file(TIMESTAMP "${DST}/index.html" out_ts)
foreach (s ${sources})
    if (EXISTS "${s}")
        file(TIMESTAMP "${s}" s_ts)
        if (s_ts STRGREATER out_ts)
            message(FATAL_ERROR "s3d8: ${s} has a timestamp in the future (${s_ts}): upstream's ui-assets.cmake "
                                "would rebuild the UI with npm instead of embedding ${SRC}")
        endif()
    endif()
endforeach()
